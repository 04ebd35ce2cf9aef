"""The daemon's edges: what it reads and drives, as small interfaces plus real implementations.

The daemon's logic (cgpu_km/daemon/) only talks to these two objects, so
tests inject fakes and run it in trio's mock time:

- `Tree`: the control tree (/proc/cgpu_km or FUSE), read node by node with
  one open/read/close each (every read is a round trip through FUSE), plus
  an optional `Watcher` (inotify) that says which nodes were written.
- `Plane`: the data plane: the regions, one dispatcher thread per GPU that
  hands the GPU to one container at a time, per-process memory from NVML
  attributed by the kernel, and stopping processes over their limit.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import time
from collections.abc import Mapping, Set
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from cgpu_km.daemon.backstop import MemoryView
from cgpu_km.daemon.dispatch import Figures
from cgpu_km.daemon.sched import GpuConfig
from cgpu_km.tree import client as treefs
from cgpu_km.tree.nodes import NODES_BY_LEVEL, Level

log = logging.getLogger("cgpu-daemon")

Key = tuple[int, str]  # (host GPU index, container name)
_GPU_NODES = frozenset(NODES_BY_LEVEL[Level.GPU])
_WRITABLE = {level: tuple(n.name for n in NODES_BY_LEVEL[level].values() if n.writable)
             for level in (Level.GPU, Level.CONTAINER)}  # what the watcher watches


@dataclass(frozen=True)
class GpuNodes:
    """The per-GPU nodes the daemon polls every period (cheap), and the container names."""

    policy: int
    max_inst: int
    prio_ratio: int
    containers: frozenset[str]


@dataclass(frozen=True)
class QuickView:
    upgrade: int
    gpus: Mapping[int, GpuNodes]
    version: str = ""  # only read on request (it never changes under a running tree)


@dataclass(frozen=True)
class ContainerNodes:
    """The container nodes the daemon uses."""

    id: int
    memsize: int
    weight: int
    highprio: int
    util_limit: int


CONTAINER_NODES = tuple(f.name for f in fields(ContainerNodes))  # checked against nodes.py


@dataclass(frozen=True)
class Change:
    """A node written: `gpu`/`name` say where (gpu None: the root's `node`;
    name None: a GPU node)."""

    gpu: int | None = None
    name: str | None = None
    node: str | None = None  # for the root: "inst_ctl" or "upgrade"


class Watcher(Protocol):
    def fileno(self) -> int:
        """Readable when changes are pending."""

    def sync(self, gpus: Mapping[int, GpuNodes]) -> None:
        """Watch the nodes of these GPUs and containers (and the root's); forget others."""

    def changes(self) -> list[Change]:
        """The changes since the last call (non-blocking)."""

    def close(self) -> None: ...


class Tree(Protocol):
    def read_quick(self, version: bool = False) -> QuickView:
        """`upgrade`, and per GPU the policy nodes and the container names."""

    def read_container(self, gpu: int, name: str) -> ContainerNodes:
        """One container's nodes; FileNotFoundError when it is gone."""

    def read_names(self) -> dict[int, frozenset[str]]:
        """Only the container names per GPU (cheap: one listing per GPU)."""

    def feed_meminfo(self, gpu: int, name: str, procs: Mapping[int, int]) -> None:
        """Replace a container's per-process memory (`meminfo` command)."""

    def finish_upgrade(self) -> None:
        """Write 0 to `upgrade`."""

    def watcher(self) -> Watcher | None:
        """A change watcher for this tree, or None (then the daemon polls every period)."""


class Plane(Protocol):
    """The data plane as the daemon's services drive it.

    `schedule`, `set_limit`, `figures` and `ticking` return at once (the
    scheduling itself runs in the plane's own threads, one per GPU); the
    others block (region files, NVML, /proc, an OOM script) and the daemon
    runs them in worker threads, each service with its own."""

    def attach(self, containers: Mapping[int, Set[str]]) -> bool:
        """Follow the tree's containers (by GPU); True when regions came or went."""

    def missing(self) -> set[str]:
        """Containers the tree lists whose region is not there yet."""

    def schedule(self, gpu: int, config: GpuConfig, state: Mapping[str, Any] | None) -> None:
        """Schedule GPU `gpu` with `config` (a dispatcher starts on first use,
        from `state` when given)."""

    def forget_gpu(self, gpu: int) -> None:
        """Stop scheduling a GPU the tree no longer has."""

    def set_limit(self, key: Key, limit: int) -> None:
        """A container's new memory limit (0: the whole device), into its region."""

    def egpu(self, key: Key) -> bool:
        """Whether the container runs in eGPU mode (over its limit: OOM script, stop)."""

    def figures(self) -> Mapping[int, Figures]:
        """Each scheduled GPU's dispatcher figures."""

    def scheduler_state(self, gpu: int) -> dict[str, Any]:
        """What `schedule` takes back as `state` after a restart."""

    def ticking(self, within: float) -> bool:
        """Every dispatcher stepped within the last `within` seconds."""

    def memory(self) -> MemoryView:
        """Per-container GPU memory from NVML, attributed by the kernel (blocking)."""

    def reclaim(self) -> int:
        """Free the process slots whose process the kernel says is gone (blocking)."""

    def stop(self, key: Key, pid: int, *, oom_script: bool = True) -> None:
        """Stop a process of container `key` (blocking: in eGPU mode, with
        `oom_script`, the container's OOM script first)."""

    def close(self) -> None:
        """Stop every dispatcher; every gate opens (fail open)."""


def read_number(path: str, attempts: int = 3) -> int:
    """One node as an integer: a single open/read/close (three FUSE round trips).

    A value that does not parse (a plain-file tree caught between a writer's
    truncate and its write) is read again a few ms later, then reported as
    OSError(EAGAIN): the daemon keeps its last view and the next change or
    poll reads it again."""
    for attempt in range(attempts):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, 64)
        finally:
            os.close(fd)
        try:
            return int(data)
        except ValueError:
            if attempt + 1 < attempts:
                time.sleep(0.005)
    raise OSError(errno.EAGAIN, f"{path} holds {data!r}, not a number")


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
            names = frozenset(os.listdir(directory)) - _GPU_NODES
            gpus[int(entry)] = GpuNodes(
                policy=read_number(f"{directory}/policy"),
                max_inst=read_number(f"{directory}/max_inst"),
                prio_ratio=read_number(f"{directory}/prio_ratio"),
                containers=names,
            )
        text = (self.root / "version").read_text().strip() if version else ""
        return QuickView(upgrade=read_number(f"{top}/upgrade"), gpus=gpus, version=text)

    def read_names(self) -> dict[int, frozenset[str]]:
        top = str(self.root)
        return {
            int(entry): frozenset(os.listdir(f"{top}/{entry}")) - _GPU_NODES
            for entry in os.listdir(top) if entry.isdigit()
        }

    def read_container(self, gpu: int, name: str) -> ContainerNodes:
        directory = f"{self.root}/{gpu}/{name}"
        return ContainerNodes(*(read_number(f"{directory}/{node}") for node in CONTAINER_NODES))

    def feed_meminfo(self, gpu: int, name: str, procs: Mapping[int, int]) -> None:
        pairs = " ".join(f"{pid}={size}" for pid, size in sorted(procs.items()))
        treefs.inst_ctl(self.root, f"meminfo {gpu} {name} {pairs}".rstrip())

    def finish_upgrade(self) -> None:
        treefs.write_node(self.root, "upgrade", 0)

    def watcher(self) -> Watcher | None:
        try:
            return InotifyWatcher(self.root)
        except OSError as error:
            log.warning("no inotify on %s (%s): polling the tree every period", self.root, error)
            return None


_IN_MODIFY = 0x002
_IN_CLOSE_WRITE = 0x008
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_DELETE = 0x200
_IN_IGNORED = 0x8000
_DIR_EVENTS = _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
_EVENT = struct.Struct("iIII")


class InotifyWatcher:
    """inotify on the tree's writable nodes and `inst_ctl` (writes through the VFS
    raise events on FUSE and procfs alike; what the module changes by itself,
    the daemon's periodic poll still sees). The directories are watched too,
    for trees whose server replaces node files by a rename (the mount-free
    tree): a watch on a replaced file dies, the next `sync` sets a new one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._libc = ctypes.CDLL(None, use_errno=True)
        fd = self._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        self._fd = int(fd)
        self._by_wd: dict[int, Change] = {}
        self._by_path: dict[str, int] = {}
        for node in ("upgrade", "inst_ctl"):
            self._add(f"{root}/{node}", Change(node=node))
        self._add(str(root), Change(node="upgrade"), _DIR_EVENTS)

    def fileno(self) -> int:
        return self._fd

    def _add(self, path: str, change: Change, mask: int = _IN_MODIFY | _IN_CLOSE_WRITE) -> None:
        if path in self._by_path:
            return
        wd = self._libc.inotify_add_watch(self._fd, path.encode(), mask)
        if wd < 0:
            return  # gone meanwhile: the next sync or poll catches up
        self._by_path[path] = wd
        self._by_wd[wd] = change

    def sync(self, gpus: Mapping[int, GpuNodes]) -> None:
        wanted: dict[str, tuple[Change, int]] = {}
        files = _IN_MODIFY | _IN_CLOSE_WRITE
        for index, nodes in gpus.items():
            wanted[f"{self.root}/{index}"] = (Change(index), _DIR_EVENTS)
            for node in _WRITABLE[Level.GPU]:
                wanted[f"{self.root}/{index}/{node}"] = (Change(index), files)
            for name in nodes.containers:
                wanted[f"{self.root}/{index}/{name}"] = (Change(index, name), _DIR_EVENTS)
                for node in _WRITABLE[Level.CONTAINER]:
                    wanted[f"{self.root}/{index}/{name}/{node}"] = (Change(index, name), files)
        for path in [p for p in self._by_path
                     if p not in wanted and self._by_wd[self._by_path[p]].gpu is not None]:
            wd = self._by_path.pop(path)
            self._by_wd.pop(wd, None)
            self._libc.inotify_rm_watch(self._fd, wd)  # fails harmlessly if already gone
        for path, (change, mask) in wanted.items():
            self._add(path, change, mask)

    def changes(self) -> list[Change]:
        found: list[Change] = []
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return found
            offset = 0
            while offset < len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                if mask & _IN_IGNORED:  # the file went (replaced): forget, sync re-adds
                    gone = self._by_wd.pop(wd, None)
                    self._by_path = {p: w for p, w in self._by_path.items() if w != wd}
                    if gone is not None and gone not in found:
                        found.append(gone)
                    continue
                change = self._by_wd.get(wd)
                if change is not None and change not in found:
                    found.append(change)

    def close(self) -> None:
        os.close(self._fd)
