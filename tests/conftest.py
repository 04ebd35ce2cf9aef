"""Shared fixtures: a real FUSE control tree mounted in a temporary folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpu_km.children import stop_child

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
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [str(VENV_BIN / "cgpu-fuse"), "--root", str(root), "--gpus", str(gpus), *extra],
                stdout=log,
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
        return stop_child(self.process, 10, signum=None)


def _gpu_count(request: pytest.FixtureRequest) -> int:
    """The indirect parameter given to mounted_tree or to control_tree (default 2)."""
    if hasattr(request, "param"):
        return int(request.param)
    callspec = getattr(request.node, "callspec", None)
    return int(callspec.params.get("control_tree", 2)) if callspec else 2


@pytest.fixture
def mounted_tree(request: pytest.FixtureRequest) -> Iterator[MountedTree]:
    """A mounted tree; `indirect` parameter: GPU count (default 2).

    It lives in a world-traversable folder (pytest's own is 0700) so that
    tests can read it as a non-root user.
    """
    folder = Path(tempfile.mkdtemp(prefix="cgpu-tree-"))
    folder.chmod(0o755)
    tree = MountedTree(folder / "cgpu_km", _gpu_count(request))
    try:
        yield tree
    finally:
        tree.stop()
        if not os.path.ismount(tree.root):
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def control_tree(mounted_tree: MountedTree) -> Path:
    """The root of a mounted tree; parametrize with `indirect=True`: GPU count (default 2)."""
    return mounted_tree.root
