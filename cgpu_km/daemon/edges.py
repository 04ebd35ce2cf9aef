"""The daemon's ports: what it reads and drives, as small interfaces.

The daemon's logic (cgpu_km/daemon/) only talks to these two objects, so
tests inject fakes and run it in trio's mock time:

- `Tree`: the control tree (/proc/cgpu_km or FUSE), read node by node with
  one open/read/close each (every read is a round trip through FUSE), plus
  an optional `Watcher` (inotify) that says which nodes were written. The
  real ones are `cgpu_km.tree.fstree.FsTree` and `cgpu_km.tree.watch`.
- `Plane`: the data plane: the regions, one dispatcher thread per GPU that
  hands the GPU to one container at a time, per-process memory from NVML
  attributed by the kernel, and the processes to stop, pinned. The
  real one is `cgpu_km.dataplane.plane.RegionPlane`.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any, Protocol

from cgpu_km.dataplane.attribution import MemoryView
from cgpu_km.dataplane.dispatch import Figures
from cgpu_km.dataplane.stopping import ScriptResult
from cgpu_km.dataplane.usage import UsageView
from cgpu_km.sched import GpuConfig
from cgpu_km.tree.views import Change, ContainerNodes, GpuNodes, Key, QuickView


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


class ScriptRun(Protocol):
    """An OOM script under way (`StopTarget.start_script`)."""

    def ended(self) -> bool:
        """Whether it ended (returns at once)."""

    def kill(self) -> None:
        """Kill it and what it started (returns at once)."""

    def end(self) -> ScriptResult:
        """Kill what is left of it; its status and output (blocking, briefly)."""


class StopTarget(Protocol):
    """A process pinned for a stop: signals reach it or nothing
    (`cgpu_km.dataplane.stopping.Target`)."""

    @property
    def pid(self) -> int: ...

    @property
    def oom_script(self) -> str:
        """The OOM script to run before the SIGKILL ("": none)."""

    def freeze(self) -> None:
        """Stop it running (SIGSTOP; returns at once)."""

    def kill(self) -> None:
        """SIGKILL (returns at once)."""

    def gone(self) -> bool:
        """Whether it has exited (returns at once)."""

    def start_script(self, timeout: float) -> ScriptRun:
        """Start `oom_script` inside its container (blocking, briefly); OSError."""

    def close(self) -> None: ...


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

    def audit(self, key: Key, length: float, why: str) -> None:
        """Ask the container's dispatcher for an audit: a quiet span of `length`
        seconds (returns at once; `why` goes to the journal when it begins)."""

    def usage(self) -> UsageView:
        """NVML's per-process GPU time since the last call, put in containers, with
        each scheduled GPU's grants (blocking)."""

    def reclaim(self) -> int:
        """Free the process slots whose process the kernel says is gone (blocking)."""

    def target(self, key: Key, pid: int, *, oom_script: bool = True) -> StopTarget | None:
        """Host pid `pid` pinned for a stop, when the kernel says it is (still) a
        process of container `key`; None when it is not (blocking, briefly). Its
        `oom_script` is the container's in eGPU mode, with `oom_script`."""

    def close(self) -> None:
        """Stop every dispatcher; every gate opens (fail open)."""
