"""The test tiers, and shared fixtures: a real FUSE control tree in a temporary folder.

Every test gets one tier marker here, from `TIERS` (the longest path prefix
of its id that the table names), so that no test file has to say it:

- unit: no root, no mounts, no containers; `make check` runs it as a normal
  user, in well under a minute in all.
- integration: root, FUSE mounts, runc and the container engines, the daemon
  on simgpu, Prometheus. A test that mounts a tree (it uses `mounted_tree`) is
  integration wherever it lives. Integration tests are skipped, with that
  reason, for a user who is not root.
- system: a VM (the kernel module's and the whole node's, in kmod/Makefile).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

from cgpu_km.children import stop_child

# `make test` gives the same result on the same tree: property tests draw the same
# examples every run. `make fuzz` explores (CGPU_HYPOTHESIS=explore): new examples,
# many more of them; what it finds becomes an @example.
hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
hypothesis_settings.register_profile("explore", max_examples=2000, print_blob=True)
hypothesis_settings.load_profile(os.environ.get("CGPU_HYPOTHESIS", "ci"))

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
TESTS = Path(__file__).resolve().parent

UNIT, INTEGRATION, SYSTEM = "unit", "integration", "system"
# Path prefixes relative to tests/, by tier; a file or test named apart from its
# folder overrides the folder.
TIERS = {
    "attacks": INTEGRATION,
    "containers": INTEGRATION,
    "daemon": INTEGRATION,
    "daemon/test_daemon.py": UNIT,
    "deviceplugin": UNIT,
    "docs": INTEGRATION,
    "envplan": UNIT,
    "fuse": INTEGRATION,
    "gpu_simulate": INTEGRATION,
    "hook": UNIT,
    "hook/test_claims.py": INTEGRATION,
    "hook/test_inroot.py::test_a_mount_named_in_bytes_that_are_not_utf8_is_read": INTEGRATION,
    "hook/test_hook_cli.py::test_pivoted_tells_an_init_that_left_the_root": INTEGRATION,
    "hook/test_runc.py": INTEGRATION,
    "kmod": UNIT,
    "libcgpu": INTEGRATION,
    "libcgpu/test_region_layout.py": UNIT,
    "libcgpu/test_region_py.py": UNIT,
    "metrics": UNIT,
    "metrics/test_daemon_scrape.py": INTEGRATION,
    "metrics/test_scrape.py": INTEGRATION,
    "node": UNIT,
    "oci": UNIT,
    "run": INTEGRATION,
    "sched": UNIT,
    "simgpu": INTEGRATION,
    "smi": INTEGRATION,
    "soak": INTEGRATION,
    "soak/test_figures.py": UNIT,
    "soak/test_plan.py": UNIT,
    "systemd": UNIT,
    "unit": UNIT,
}
MOUNTS = frozenset({"mounted_tree"})  # fixtures that make a test integration


def tier_of(nodeid: str, fixtures: Sequence[str] = ()) -> str:
    """The tier of the test `nodeid` (relative to tests/) that uses `fixtures`."""
    path = nodeid.split("::")[0]
    prefixes = [p for p in TIERS if nodeid == p or path == p or path.startswith(p + "/")
                or nodeid.startswith(p + "::")]
    if not prefixes:
        raise LookupError(f"tests/{path}: no tier in tests/conftest.py TIERS")
    tier = TIERS[max(prefixes, key=len)]
    return INTEGRATION if tier == UNIT and MOUNTS & set(fixtures) else tier


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    not_root = pytest.mark.skip(reason="integration tier: needs root")
    for item in items:
        nodeid = Path(item.path).relative_to(TESTS).as_posix()
        nodeid += item.nodeid[len(item.nodeid.split("::")[0]):]
        tier = tier_of(nodeid, getattr(item, "fixturenames", ()))
        item.add_marker(getattr(pytest.mark, tier))
        if tier == INTEGRATION and os.geteuid() != 0:
            item.add_marker(not_root)


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
