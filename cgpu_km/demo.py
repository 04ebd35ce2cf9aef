"""`make demo`: the system's main job, shown step by step on this host.

Mounts the control tree with FUSE in a temporary folder, shows it, drives
it with a real shell the way an operator would, and unmounts it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BIN = Path(sys.executable).parent


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def shell(command: str, cwd: Path) -> None:
    """Run one operator command and show it with its output."""
    print(f"$ {command}", flush=True)
    result = subprocess.run(
        ["bash", "-c", command], cwd=cwd, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    sys.stdout.write(result.stdout)
    sys.stdout.flush()


@contextmanager
def fuse_tree(gpus: int) -> Iterator[Path]:
    """A control tree served by cgpu-fuse for the duration of the block."""
    folder = Path(tempfile.mkdtemp(prefix="cgpu-demo-"))
    root = folder / "cgpu_km"
    root.mkdir()
    process = subprocess.Popen([str(BIN / "cgpu-fuse"), "--root", str(root), "--gpus", str(gpus)])
    try:
        deadline = time.monotonic() + 15
        while not os.path.ismount(root):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("demo: cgpu-fuse did not mount the tree")
            time.sleep(0.05)
        yield root
    finally:
        subprocess.run(["fusermount", "-u", str(root)], check=False)
        process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    step("the control tree, served by cgpu-fuse with 2 GPUs")
    with fuse_tree(2) as root:
        print(f"root: {root}")
        shell("ls -l . 0", root)
        shell("cat version 0/policy 0/max_inst 0/free_weight", root)
        step("register two containers through inst_ctl, as the OCI hook does")
        shell("echo 'add 0 web-6g memsize=6337593753 weight=1' > inst_ctl", root)
        shell("echo 'add 0 train-8g memsize=8450125004 weight=2' > inst_ctl", root)
        shell("ls 0; cat 0/free_weight", root)
        step("tune live: weighted policy, and a rejected weight")
        shell("echo 2 > 0/policy; cat 0/policy", root)
        shell("echo 20 > 0/train-8g/weight; cat 0/train-8g/weight", root)
        shell("echo 'meminfo 0 web-6g 4242=1073741824' > inst_ctl; cat 0/web-6g/meminfo", root)
        shell("echo -web-6g > inst_ctl; echo 'del 0 train-8g' > inst_ctl; ls 0", root)
    step("unmounted; done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
