"""The daemon's edges: what it reads and drives, as small interfaces plus real implementations.

The daemon's logic (cgpu_km/daemon.py) only talks to these two objects, so
tests inject fakes and run it in trio's mock time:

- `Tree`: the control tree (/proc/cgpu_km or FUSE), read node by node with
  one open/read/close each (every read is a round trip through FUSE), plus
  an optional `Watcher` (inotify) that says which nodes were written.
- `Plane`: the data plane: per-container GPU time and activity, the gates,
  the heartbeat, per-process memory from NVML, and stopping processes that
  are over their memory limit. Its calls block (NVML, file I/O); the daemon
  runs them in a worker thread.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import struct
import subprocess
import time
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cgpu_km import treefs
from cgpu_km.nodes import NODES_BY_LEVEL, Level

log = logging.getLogger("cgpu-daemon")

Key = tuple[int, str]  # (host GPU index, container name)
_GPU_NODES = frozenset(NODES_BY_LEVEL[Level.GPU])


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


CONTAINER_NODES = ("id", "memsize", "weight", "highprio", "util_limit")


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


@dataclass(frozen=True)
class PlaneSample:
    """What the data plane measured at one instant."""

    usage: Mapping[Key, float]  # cumulative GPU busy seconds per container and GPU
    active: Set[Key]  # containers that have work waiting or ran work lately
    gate_wait: Mapping[Key, float] = field(default_factory=dict)  # cumulative seconds
    oom_refusals: Mapping[Key, int] = field(default_factory=dict)  # cumulative count


@dataclass(frozen=True)
class ProcessMemory:
    """GPU memory per process, by container (from NVML), and GPU totals."""

    by_container: Mapping[Key, Mapping[int, int]]
    used_by_gpu: Mapping[int, int] = field(default_factory=dict)


class Plane(Protocol):
    def attach(self, containers: Mapping[int, Set[str]]) -> None:
        """(Re)discover the regions of these containers (by GPU); forget the others."""

    def sample(self) -> PlaneSample:
        """Usage and activity now (blocking)."""

    def set_gates(self, gpu: int, open_: Set[str]) -> None:
        """Open the gates of `open_` on `gpu` and close the others' (blocking)."""

    def heartbeat(self) -> None:
        """Tell every region the daemon is alive (gates fail open without it)."""

    def open_all(self) -> None:
        """Open every gate (on exit: fail open)."""

    def memory(self) -> ProcessMemory:
        """Per-process GPU memory by container (blocking, NVML)."""

    def stop(self, gpu: int, name: str, pids: list[int]) -> None:
        """Stop processes over their container's limit (OOM script first in eGPU mode)."""


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
            for node in ("policy", "max_inst", "prio_ratio"):
                wanted[f"{self.root}/{index}/{node}"] = (Change(index), files)
            for name in nodes.containers:
                wanted[f"{self.root}/{index}/{name}"] = (Change(index, name), _DIR_EVENTS)
                for node in ("memsize", "weight", "highprio", "util_limit"):
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


class OpenPlane:
    """`Plane` that gates nothing and measures nothing (no regions, no NVML)."""

    def __init__(self) -> None:
        self.names: dict[int, set[str]] = {}

    def attach(self, containers: Mapping[int, Set[str]]) -> None:
        self.names = {gpu: set(names) for gpu, names in containers.items()}

    def sample(self) -> PlaneSample:
        return PlaneSample(usage={}, active=set())

    def set_gates(self, gpu: int, open_: Set[str]) -> None:
        return None

    def heartbeat(self) -> None:
        return None

    def open_all(self) -> None:
        return None

    def memory(self) -> ProcessMemory:
        return ProcessMemory(by_container={})

    def stop(self, gpu: int, name: str, pids: list[int]) -> None:
        stop_processes(pids, oom_script="")


def stop_processes(pids: list[int], oom_script: str, timeout: float = 5.0) -> None:
    """Run the OOM script (if any) for each process, then SIGKILL it.

    The script gets the process id as its argument and `CGPU_OOM_PID` in its
    environment; it may take up to `timeout` seconds.
    """
    for pid in pids:
        if oom_script:
            try:
                subprocess.run(
                    [oom_script, str(pid)], timeout=timeout, check=False,
                    env={**os.environ, "CGPU_OOM_PID": str(pid)},
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                )
            except (OSError, subprocess.TimeoutExpired) as error:
                log.warning("OOM script %s for pid %d failed: %s", oom_script, pid, error)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        except PermissionError as error:
            log.warning("cannot stop pid %d: %s", pid, error)
