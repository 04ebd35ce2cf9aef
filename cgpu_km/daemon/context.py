"""What the daemon's services share: timing settings, the view of the tree, workers."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from cgpu_km.dataplane.stopping import OOM_SCRIPT_TIMEOUT
from cgpu_km.sched import QUANTUM, ContainerSpec, GpuConfig
from cgpu_km.tree.views import GpuNodes, Key

T = TypeVar("T")
BYPASS_ACTIONS = ("stop", "report")
Blocking = Callable[[Callable[[], T]], Awaitable[T]]


@dataclass(frozen=True)
class Settings:
    """Timing knobs (seconds)."""

    period: float = 0.1  # tree polls without inotify, and the look for new regions
    slice: float = QUANTUM  # the scheduling quantum: one container's turn on a GPU (about)
    tree_refresh: float = 5.0  # poll of the GPU nodes while inotify watches the tree
    full_refresh: float = 30.0  # every container's nodes, in case a change was missed
    memory_interval: float = 0.5
    reclaim_interval: float = 1.0  # the kernel is asked which slots' processes are gone
    publish_interval: float = 2.0  # snapshot for cgpu-smi and /metrics
    save_interval: float = 5.0  # state file (also written on exit and before a hot update)
    stop_deadline: float = 15.0  # a process frozen for its OOM script is killed within this
    oom_script_timeout: float = OOM_SCRIPT_TIMEOUT  # an OOM script's deadline and turn wait
    oom_scripts: int = 4  # OOM scripts run at once, node-wide (the others wait, frozen)
    call_deadline: float = 30.0  # a blocking call (a wedged FUSE mount, a hung NVML) after this
    # A process of a managed container that holds GPU memory without libcgpu
    # (policies 0-4): "stop" (SIGKILL) or "report" (the journal, cgpu-smi and
    # the metrics only); the containers named in `report_bypass` are only reported.
    on_bypass: str = "stop"
    report_bypass: frozenset[str] = frozenset()
    # The compute check (policies 0-4): a container whose processes' NVML samples,
    # over this many seconds, add up to more than `compute_tolerance` times the
    # time it was granted (NVML may read a process up to about 1.4 times what it
    # ran), or that ran while it held no grant, has the processes that did it
    # stopped or reported as `on_bypass` says.
    compute_window: float = 2.0
    compute_interval: float = 0.25  # NVML's per-process samples are read this often
    audit_every: float = 300.0  # a busy container is audited at least this often
    compute_tolerance: float = 1.5
    # Each GPU's dispatcher thread runs under SCHED_FIFO at this priority (0: the
    # default policy): a host busy with other work then delays no step.
    dispatch_priority: int = 1

    def __post_init__(self) -> None:
        for name in ("period", "slice", "tree_refresh", "full_refresh", "memory_interval",
                     "reclaim_interval", "publish_interval", "save_interval", "stop_deadline",
                     "call_deadline", "compute_window", "compute_tolerance",
                     "compute_interval", "audit_every"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        if not (isinstance(self.oom_script_timeout, int | float)
                and math.isfinite(self.oom_script_timeout) and self.oom_script_timeout > 0):
            raise ValueError("oom_script_timeout must be a positive number of seconds, not "
                             f"{self.oom_script_timeout!r}")
        if not (isinstance(self.oom_scripts, int) and self.oom_scripts > 0):
            raise ValueError(f"oom_scripts must be a positive count, not {self.oom_scripts!r}")
        if not (type(self.dispatch_priority) is int and 0 <= self.dispatch_priority <= 99):
            raise ValueError("dispatch_priority must be 0 (the default policy) or a SCHED_FIFO "
                             f"priority 1-99, not {self.dispatch_priority!r}")
        if self.on_bypass not in BYPASS_ACTIONS:
            raise ValueError(f"on_bypass must be {' or '.join(BYPASS_ACTIONS)}, "
                             f"not {self.on_bypass!r}")

    def stops_bypass(self, container: str) -> bool:
        """Whether a process of `container` that bypasses libcgpu is stopped."""
        return self.on_bypass == "stop" and container not in self.report_bypass


def gpu_config(nodes: GpuNodes, specs: Mapping[str, ContainerSpec]) -> GpuConfig:
    """The scheduler's configuration of one GPU from its nodes and its containers'."""
    return GpuConfig(
        policy=nodes.policy,  # type: ignore[arg-type]  # GpuConfig converts and checks
        max_inst=nodes.max_inst,
        prio_ratio=nodes.prio_ratio,
        containers={n: specs.get(n, ContainerSpec(weight=0)) for n in sorted(nodes.containers)},
    )


@dataclass(frozen=True)
class Limits:
    """What the memory service needs of the tree, handed over by the tree
    service at every change of it: each listed container's memory limit, the
    GPUs whose processes must go through libcgpu, and the limits lowered."""

    memsize: Mapping[Key, int]  # 0: the whole device
    managed: frozenset[int] = frozenset()  # GPUs listed under policies 0-4
    lowered: frozenset[Key] = frozenset()  # since the previous Limits


@dataclass(frozen=True)
class KnownContainer:
    """What the daemon knows of one container: its id, memory limit and compute.

    (Not `cgpu_km.tree.client.ContainerView`, which is all of a container's
    nodes as `cgpu-smi` reads them.)"""

    id: int
    memsize: int  # bytes, 0: the whole device
    spec: ContainerSpec


@dataclass
class DaemonView:
    """What the daemon knows of the tree (merged from quick polls and full reads)."""

    nodes: dict[int, GpuNodes] = field(default_factory=dict)
    containers: dict[Key, KnownContainer] = field(default_factory=dict)

    def config(self, gpu: int) -> GpuConfig:
        nodes = self.nodes[gpu]
        specs = {n: c.spec for (g, n), c in self.containers.items() if g == gpu}
        return gpu_config(nodes, specs)

    def memsize(self) -> dict[Key, int]:
        """Every container's memory limit."""
        return {key: c.memsize for key, c in self.containers.items()}

    def keep(self, present: Set[Key]) -> None:
        """Forget the containers not in `present`."""
        self.containers = {k: c for k, c in self.containers.items() if k in present}

    def listed(self) -> dict[int, set[str]]:
        """The containers each GPU lists."""
        return {g: set(nodes.containers) for g, nodes in self.nodes.items()}


class Ticks:
    """`async for _ in Ticks(interval)`: every `interval` seconds on a fixed
    schedule, so a slow round shortens the wait after it and the service does
    not drift; with `at_once` the first comes at once. (A class, not an async
    generator: a loop left by `break` or cancellation has nothing to close.)"""

    def __init__(self, interval: float, *, at_once: bool = False) -> None:
        self.interval = interval
        self._at_once = at_once
        self._deadline: float | None = None

    def __aiter__(self) -> Ticks:
        return self

    async def __anext__(self) -> None:
        if self._deadline is None:
            self._deadline = trio.current_time()
            if self._at_once:
                await trio.lowlevel.checkpoint()
                return
        self._deadline += self.interval
        await trio.sleep_until(self._deadline)


class Worker:
    """One service's worker thread: its blocking calls run there, one at a time,
    so a slow call (a hung NVML, a wedged FUSE mount) holds up that service only.

    A call still running after `deadline` seconds, or when its task is
    cancelled (the daemon exits), is abandoned: the thread is left to finish
    on its own, holding the worker, and the caller gets TimeoutError (an
    OSError, as the services expect of their edges) or the cancellation, so
    nothing waits on it, least of all opening the gates on the way out.
    With `inline` (tests), calls run through it instead."""

    def __init__(self, name: str, inline: Blocking[Any] | None = None, *, threads: int = 1,
                 deadline: float | None = None) -> None:
        self.name = name
        self.deadline = deadline
        self._inline = inline
        self._limiter = trio.CapacityLimiter(threads)

    async def __call__(self, fn: Callable[[], T]) -> T:
        if self._inline is not None:
            result: T = await self._inline(fn)
            return result
        with trio.move_on_after(math.inf if self.deadline is None else self.deadline):
            return await trio.to_thread.run_sync(fn, limiter=self._limiter,
                                                 abandon_on_cancel=True)
        raise TimeoutError(f"the {self.name} worker gave no answer in {self.deadline:g} s")
