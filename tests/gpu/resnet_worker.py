"""ResNet50 FP16 inference worker for the real-GPU validation (torch + torchvision).

    python3 resnet_worker.py NAME SYNC_DIR

Random weights (`resnet50(weights=None)`: nothing is downloaded) and random
inputs, `torch.inference_mode()`, cuDNN autotuning, channels-last FP16. One
step is one batch through the network followed by a synchronize, so a
step's completion time is when its images are done. The phases come from
`SYNC_DIR/plan.json` (see phases.py).

The forward pass is captured in a CUDA graph (one launch per batch, as an
inference engine such as TensorRT runs it), so that small batches are bound
by the GPU, not by Python's launch overhead: the test measures how the GPU
is shared. `VALIDATE_CUDA_GRAPHS=0` runs it eagerly; a capture that fails
falls back to eager too. Each result records which (`"graph"`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))

if TYPE_CHECKING:  # mypy knows tests/gpu/phases.py by its package path
    from tests.gpu import phases
else:  # run as a script, next to phases.py
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

    use_graphs = os.environ.get("VALIDATE_CUDA_GRAPHS", "1") != "0"

    def make_step(batch: int) -> Callable[[], None]:
        images = torch.randn(batch, 3, 224, 224, device=device, dtype=torch.half)
        images = images.contiguous(memory_format=torch.channels_last)

        def eager() -> None:
            model(images)
            torch.cuda.synchronize()

        if not use_graphs:
            phases.NOTES["graph"] = False
            return eager
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # cuDNN autotuning and lazy loading happen outside the capture
                    model(images)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model(images)
        except Exception as error:
            print(f"worker {name}: CUDA graph capture at batch {batch} failed ({error!r}); "
                  "running eagerly", flush=True)
            torch.cuda.synchronize()
            phases.NOTES["graph"] = False
            return eager

        def replay() -> None:
            graph.replay()
            torch.cuda.synchronize()

        phases.NOTES["graph"] = True
        return replay

    return phases.worker_main(name, sync, make_step)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
