"""In-memory stand-ins for the daemon's edges: a control tree and a data plane on engine models.

`MemoryTree` holds a tree in memory with the daemon-facing operations of
`cgpu_km.daemon_io.Tree`; `SimPlane` runs one `cgpu_km.sched_sim.EngineSim`
per GPU in the time given by a clock function (trio's clock in tests, so
mock time works), with the daemon's gates deciding who may launch. Used by
the daemon's tests and by the benchmark; nothing here touches the system.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass, field

from cgpu_km.daemon_io import ContainerNodes, GpuNodes, Key, PlaneSample, ProcessMemory, QuickView
from cgpu_km.sched_sim import EngineSim, SimProcess
from cgpu_km.treefs import ContainerView, GpuView


@dataclass
class MemoryTree:
    """A control tree in memory: edit `gpus` directly, as an operator's `echo` would."""

    gpus: list[GpuView] = field(default_factory=list)
    upgrade: int = 0
    fail: bool = False  # reads raise OSError (tree unmounted)
    meminfo_writes: list[tuple[int, str, dict[int, int]]] = field(default_factory=list)
    reads: int = 0

    @classmethod
    def with_gpus(cls, count: int, policy: int = 1, max_inst: int = 16) -> MemoryTree:
        return cls([GpuView(i, policy, max_inst, 80, max_inst, 0) for i in range(count)])

    def add(self, gpu: int, name: str, weight: int = 1, *, memsize: int = 0,
            highprio: int = 0, util_limit: int = 0) -> ContainerView:
        ids = [c.id for g in self.gpus for c in g.containers.values()]
        view = ContainerView(name, max(ids, default=0) + 1, memsize, weight, highprio,
                             util_limit, memsize)
        self.gpus[gpu].containers[name] = view
        return view

    def _check(self) -> None:
        if self.fail:
            raise OSError(107, "Transport endpoint is not connected")

    def read_container(self, gpu: int, name: str) -> ContainerNodes:
        self._check()
        self.reads += 1
        found = self.gpus[gpu].containers.get(name)
        if found is None:
            raise FileNotFoundError(2, f"no container {name} on GPU {gpu}")
        return ContainerNodes(found.id, found.memsize, found.weight, found.highprio,
                              found.util_limit)

    def read_names(self) -> dict[int, frozenset[str]]:
        self._check()
        return {g.index: frozenset(g.containers) for g in self.gpus}

    def read_quick(self, version: bool = False) -> QuickView:
        self._check()
        self.reads += 1
        return QuickView(
            version="0.1.0" if version else "",
            upgrade=self.upgrade,
            gpus={
                g.index: GpuNodes(g.policy, g.max_inst, g.prio_ratio, frozenset(g.containers))
                for g in self.gpus
            },
        )

    def feed_meminfo(self, gpu: int, name: str, procs: Mapping[int, int]) -> None:
        self._check()
        if name not in self.gpus[gpu].containers:
            raise FileNotFoundError(2, "No such container")
        self.gpus[gpu].containers[name].procs = dict(procs)
        self.meminfo_writes.append((gpu, name, dict(procs)))

    def finish_upgrade(self) -> None:
        self._check()
        self.upgrade = 0

    def watcher(self) -> None:
        return None


class SimPlane:
    """A data plane over engine models: every container's processes are backlogged.

    `demand` may be changed at any time (containers with work); `memory_by`
    is what NVML would report per container.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        processes: Mapping[int, Iterable[SimProcess]],
        demand: Set[Key] | None = None,
    ) -> None:
        self.clock = clock
        self.engines = {gpu: EngineSim(procs) for gpu, procs in processes.items()}
        self.demand: set[Key] = set(demand) if demand is not None else {
            (gpu, p.container) for gpu, e in self.engines.items() for p in e.processes
        }
        self.memory_by: dict[Key, dict[int, int]] = {}
        self.open: dict[int, frozenset[str]] = {g: frozenset() for g in self.engines}
        self.all_open = False
        self.stopped: list[tuple[int, str, list[int]]] = []
        self.heartbeats = 0
        self.attached: dict[int, set[str]] = {}
        self.gate_writes = 0

    def _advance(self) -> None:
        now = self.clock()
        for gpu, engine in self.engines.items():
            engine.run_until(now)
            engine.set_demand({n for (g, n) in self.demand if g == gpu})

    def attach(self, containers: Mapping[int, Set[str]]) -> None:
        self.attached = {gpu: set(names) for gpu, names in containers.items()}

    def sample(self) -> PlaneSample:
        self._advance()
        usage = {
            (gpu, name): busy
            for gpu, engine in self.engines.items()
            for name, busy in engine.usage().items()
        }
        return PlaneSample(usage=usage, active=set(self.demand))

    def set_gates(self, gpu: int, open_: Set[str]) -> None:
        self._advance()
        self.gate_writes += 1
        self.open[gpu] = frozenset(open_)
        if gpu in self.engines:
            self.engines[gpu].set_gates(open_)

    def heartbeat(self) -> None:
        self.heartbeats += 1

    def open_all(self) -> None:
        self._advance()
        self.all_open = True
        for gpu, engine in self.engines.items():
            names = {p.container for p in engine.processes}
            self.open[gpu] = frozenset(names)
            engine.set_gates(names)

    def memory(self) -> ProcessMemory:
        return ProcessMemory(by_container={k: dict(v) for k, v in self.memory_by.items()})

    def stop(self, gpu: int, name: str, pids: list[int]) -> None:
        self.stopped.append((gpu, name, list(pids)))
        procs = self.memory_by.get((gpu, name), {})
        for pid in pids:
            procs.pop(pid, None)

    def busy(self) -> dict[Key, float]:
        self._advance()
        return {
            (gpu, name): busy
            for gpu, engine in self.engines.items()
            for name, busy in engine.usage().items()
        }
