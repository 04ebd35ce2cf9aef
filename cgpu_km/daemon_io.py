"""The daemon's edges: what it reads and drives, as small interfaces plus real implementations.

The daemon's logic (cgpu_km/daemon.py) only talks to these two objects, so
tests inject fakes and run it in trio's mock time:

- `Tree`: the control tree (`cgpu_km.treefs` over /proc/cgpu_km or FUSE).
- `Plane`: the data plane: per-container GPU time and activity, the gates,
  the heartbeat, per-process memory from NVML, and stopping processes that
  are over their memory limit. Its calls block (NVML, file I/O); the daemon
  runs them in a worker thread.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cgpu_km import treefs
from cgpu_km.treefs import TreeView

log = logging.getLogger("cgpu-daemon")

Key = tuple[int, str]  # (host GPU index, container name)


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


class Tree(Protocol):
    def read(self) -> TreeView:
        """The whole tree (every container's nodes)."""

    def read_quick(self) -> QuickView:
        """`upgrade`, and per GPU the policy nodes and the container names."""

    def feed_meminfo(self, gpu: int, name: str, procs: Mapping[int, int]) -> None:
        """Replace a container's per-process memory (`meminfo` command)."""

    def finish_upgrade(self) -> None:
        """Write 0 to `upgrade`."""


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
    def attach(self, tree: TreeView) -> None:
        """(Re)discover the regions of the tree's containers; forget removed ones."""

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


class FsTree:
    """`Tree` over the real control tree through `cgpu_km.treefs`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def read(self) -> TreeView:
        return treefs.read_tree(self.root)

    def read_quick(self) -> QuickView:
        gpus: dict[int, GpuNodes] = {}
        for entry in os.scandir(self.root):
            if not entry.name.isdigit():
                continue
            directory = Path(entry.path)
            names = frozenset(
                e.name for e in os.scandir(directory) if e.is_dir(follow_symlinks=False)
            )
            gpus[int(entry.name)] = GpuNodes(
                policy=treefs.read_int(directory / "policy"),
                max_inst=treefs.read_int(directory / "max_inst"),
                prio_ratio=treefs.read_int(directory / "prio_ratio"),
                containers=names,
            )
        return QuickView(upgrade=treefs.read_int(self.root / "upgrade"), gpus=gpus)

    def feed_meminfo(self, gpu: int, name: str, procs: Mapping[int, int]) -> None:
        pairs = " ".join(f"{pid}={size}" for pid, size in sorted(procs.items()))
        treefs.inst_ctl(self.root, f"meminfo {gpu} {name} {pairs}".rstrip())

    def finish_upgrade(self) -> None:
        treefs.write_node(self.root, "upgrade", 0)


class OpenPlane:
    """`Plane` that gates nothing and measures nothing (no regions, no NVML)."""

    def __init__(self) -> None:
        self.names: dict[int, set[str]] = {}

    def attach(self, tree: TreeView) -> None:
        self.names = {g.index: set(g.containers) for g in tree.gpus}

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
