"""Shared fixtures: a real FUSE control tree mounted in a temporary folder."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def _unmount(root: Path) -> None:
    for args in (["fusermount", "-u", str(root)], ["fusermount", "-u", "-z", str(root)]):
        if not os.path.ismount(root):
            return
        subprocess.run(args, check=False, capture_output=True)
        for _ in range(50):
            if not os.path.ismount(root):
                return
            time.sleep(0.05)


class MountedTree:
    """A running `cgpu-fuse` process and its mount point."""

    def __init__(self, root: Path, gpus: int, *extra: str) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.log = root.parent / f"{root.name}.log"
        self.process = subprocess.Popen(
            [str(VENV_BIN / "cgpu-fuse"), "--root", str(root), "--gpus", str(gpus), *extra],
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 15
        while not os.path.ismount(root):
            if self.process.poll() is not None:
                raise RuntimeError(f"cgpu-fuse exited: {self.log.read_text()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("cgpu-fuse did not mount within 15 s")
            time.sleep(0.05)

    def stop(self) -> int | None:
        """Unmount and return cgpu-fuse's exit status."""
        _unmount(self.root)
        try:
            return self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


@pytest.fixture
def mounted_tree(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MountedTree]:
    """A mounted tree; `indirect` parameter: GPU count (default 2)."""
    gpus = getattr(request, "param", 2)
    tree = MountedTree(tmp_path / "cgpu_km", gpus)
    try:
        yield tree
    finally:
        tree.stop()


@pytest.fixture
def control_tree(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """The root of a mounted tree; `indirect` parameter: GPU count (default 2)."""
    gpus = getattr(request, "param", 2)
    tree = MountedTree(tmp_path / "cgpu_km", gpus)
    try:
        yield tree.root
    finally:
        tree.stop()
