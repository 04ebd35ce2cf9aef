"""Fixtures for the attack suite: one FUSE tree for the whole folder, a built
attack program and root filesystem, and a fresh simulated host per test."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.attacks.node import (
    Node,
    build_attacker,
    build_rawlaunch,
    built_node,
    make_rootfs,
    missing,
)
from tests.conftest import MountedTree
from tests.daemon.simbox import SHAREWORK


@pytest.fixture(scope="session")
def attack_rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """busybox, the attack program and sharework with their libraries (copied per container)."""
    why = missing()
    if why is not None:
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("attack-build")
    root = folder / "rootfs"
    make_rootfs(root, [build_attacker(folder), SHAREWORK])
    return root


@pytest.fixture(scope="session")
def rawlaunch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/attacks/rawlaunch.c built: a preload that launches past libcgpu's gate."""
    return build_rawlaunch(tmp_path_factory.mktemp("rawlaunch"))


@pytest.fixture(scope="session")
def attack_tree() -> Iterator[Path]:
    """One mounted control tree (1 GPU) for the folder: mounting costs seconds per test."""
    why = missing()
    if why is not None:
        pytest.skip(why)
    folder = Path(tempfile.mkdtemp(prefix="cgpu-attack-tree-"))
    folder.chmod(0o755)
    tree = MountedTree(folder / "cgpu_km", 1)
    try:
        yield tree.root
    finally:
        tree.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def make_node(attack_tree: Path, attack_rootfs: Path) -> Iterator[Callable[..., Node]]:
    """Build the test's host (`built_node`); torn down after the test."""
    with contextlib.ExitStack() as stack:
        yield lambda context_mem="0": stack.enter_context(
            built_node(attack_tree, attack_rootfs, context_mem))


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    """A host with simgpu's contexts free of charge (SIMGPU_CONTEXT_MEM=0)."""
    return make_node()
