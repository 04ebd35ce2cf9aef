"""The real `Tree` port: the control tree (/proc/cgpu_km, FUSE or the mount-free
tree) read node by node, and its inotify watcher."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from cgpu_km.tree import client as treefs
from cgpu_km.tree.nodes import NODES_BY_LEVEL, Level
from cgpu_km.tree.views import CONTAINER_NODES, GPU_NODES, ContainerNodes, GpuNodes, QuickView
from cgpu_km.tree.watch import InotifyWatcher

log = logging.getLogger("cgpu-daemon")

_GPU_LEVEL_NODES = frozenset(NODES_BY_LEVEL[Level.GPU])


def read_number(path: str, attempts: int = 3, *, dir_fd: int | None = None,
                dir_path: str = "") -> int:
    """One node as an integer: a single open/read/close (`path` relative to
    `dir_fd`, the directory `dir_path`, when given: no lookup of the
    directories above it, which FUSE, with its caches off, makes per node).

    A value that does not parse (a plain-file tree caught between a writer's
    truncate and its write) is read again a few ms later, then reported as
    OSError(EAGAIN): the daemon keeps its last view and the next change or
    poll reads it again."""
    for attempt in range(attempts):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            data = os.read(fd, 64)
        finally:
            os.close(fd)
        try:
            return int(data)
        except ValueError:
            if attempt + 1 < attempts:
                time.sleep(0.005)
    shown = f"{dir_path}/{path}" if dir_path else path
    raise OSError(errno.EAGAIN, f"{shown} holds {data!r}, not a number")


def read_numbers(directory: str, nodes: Sequence[str]) -> list[int]:
    """These nodes of one directory, each as `read_number` reads it."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return [read_number(node, dir_fd=fd, dir_path=directory) for node in nodes]
    finally:
        os.close(fd)


class FsTree:
    """`Tree` over the real control tree (/proc/cgpu_km or the FUSE mount)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def read_quick(self, version: bool = False) -> QuickView:
        gpus: dict[int, GpuNodes] = {}
        top = str(self.root)
        for entry in os.listdir(top):
            if not entry.isdigit():
                continue
            directory = f"{top}/{entry}"
            # Everything that is not a GPU-level node is a container (no stat per entry).
            names = frozenset(os.listdir(directory)) - _GPU_LEVEL_NODES
            numbers = dict(zip(GPU_NODES, read_numbers(directory, GPU_NODES), strict=True))
            gpus[int(entry)] = GpuNodes(**numbers, containers=names)
        text = (self.root / "version").read_text().strip() if version else ""
        return QuickView(upgrade=read_number(f"{top}/upgrade"), gpus=gpus, version=text)

    def read_names(self) -> dict[int, frozenset[str]]:
        top = str(self.root)
        return {
            int(entry): frozenset(os.listdir(f"{top}/{entry}")) - _GPU_LEVEL_NODES
            for entry in os.listdir(top) if entry.isdigit()
        }

    def read_container(self, gpu: int, name: str) -> ContainerNodes:
        return ContainerNodes(*read_numbers(f"{self.root}/{gpu}/{name}", CONTAINER_NODES))

    def feed_meminfo(self, gpu: int, name: str, procs: Mapping[int, int]) -> None:
        pairs = " ".join(f"{pid}={size}" for pid, size in sorted(procs.items()))
        treefs.inst_ctl(self.root, f"meminfo {gpu} {name} {pairs}".rstrip())

    def finish_upgrade(self) -> None:
        treefs.write_node(self.root, "upgrade", 0)

    def watcher(self) -> InotifyWatcher | None:
        try:
            return InotifyWatcher(self.root)
        except OSError as error:
            log.warning("no inotify on %s (%s): polling the tree every period", self.root, error)
            return None
