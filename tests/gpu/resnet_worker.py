"""ResNet50 FP16 inference worker for the real-GPU validation (torch + torchvision).

    python3 resnet_worker.py NAME SYNC_DIR

Random weights (`resnet50(weights=None)`: nothing is downloaded) and random
inputs, `torch.inference_mode()`, cuDNN autotuning, channels-last FP16. One
step is one batch through the network followed by a synchronize, so a
step's completion time is when its images are done. The phases come from
`SYNC_DIR/plan.json` (see phases.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases


def main(name: str, sync: Path) -> int:
    import torch
    import torchvision

    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    model = torchvision.models.resnet50(weights=None)
    model = model.eval().half().to(device).to(memory_format=torch.channels_last)
    inference = torch.inference_mode()
    inference.__enter__()

    def make_step(batch: int) -> Callable[[], None]:
        images = torch.randn(batch, 3, 224, 224, device=device, dtype=torch.half)
        images = images.contiguous(memory_format=torch.channels_last)

        def step() -> None:
            model(images)
            torch.cuda.synchronize()

        return step

    return phases.worker_main(name, sync, make_step)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
