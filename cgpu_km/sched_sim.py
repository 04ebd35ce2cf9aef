"""Pure discrete-event model of one GPU engine, for testing and benchmarking the scheduler.

The engine runs kernels one at a time in submission order (FIFO), as
simgpu's engine does. Each process keeps up to `depth` kernels queued
while its container's gate is open and it has work; a closed gate stops
new launches but not what is already queued, so work runs past a slice's
end, as on a real GPU. Busy time is charged to the kernel's container as
it runs. `run(...)` drives a `GateScheduler` against the model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass

from cgpu_km.sched import GateScheduler

__all__ = ["EngineSim", "SimProcess", "run"]


@dataclass(frozen=True)
class SimProcess:
    """A process of `container` that launches kernels of `kernel_s` seconds."""

    container: str
    kernel_s: float
    depth: int = 2
    think_s: float = 0.0  # pause after each kernel before the next launch (light load)


class EngineSim:
    """One GPU engine shared by processes; time advances only through `run_until`."""

    def __init__(self, processes: Iterable[SimProcess]) -> None:
        self.processes = list(processes)
        for proc in self.processes:
            if proc.kernel_s <= 0 or proc.depth < 1:
                raise ValueError(f"bad process {proc}")
        self.now = 0.0
        self._outstanding = [0] * len(self.processes)
        self._ready_at = [0.0] * len(self.processes)
        self._queue: deque[int] = deque()
        self._running: int | None = None
        self._started = 0.0
        self._busy: dict[str, float] = {p.container: 0.0 for p in self.processes}
        self._open: frozenset[str] = frozenset()
        self._demand: frozenset[str] = frozenset()
        self.kernels_done: dict[str, int] = {p.container: 0 for p in self.processes}

    def set_gates(self, open_: Set[str]) -> None:
        self._open = frozenset(open_)
        self._refill_all()

    def set_demand(self, containers: Set[str]) -> None:
        self._demand = frozenset(containers)
        self._refill_all()

    def usage(self) -> dict[str, float]:
        """Cumulative busy seconds per container, the running kernel's part included."""
        usage = dict(self._busy)
        if self._running is not None:
            owner = self.processes[self._running].container
            usage[owner] += self.now - self._started
        return usage

    def _may_launch(self, index: int) -> bool:
        proc = self.processes[index]
        return (
            proc.container in self._open
            and proc.container in self._demand
            and self._outstanding[index] < proc.depth
            and self._ready_at[index] <= self.now
        )

    def _refill(self, index: int) -> None:
        while self._may_launch(index):
            self._outstanding[index] += 1
            self._queue.append(index)

    def _refill_all(self) -> None:
        for index in range(len(self.processes)):
            self._refill(index)

    def _wake_thinkers(self) -> None:
        for index, ready_at in enumerate(self._ready_at):
            if 0.0 < ready_at <= self.now:
                self._ready_at[index] = 0.0
                self._refill(index)

    def run_until(self, t: float) -> None:
        while True:
            self._wake_thinkers()
            if self._running is None:
                if not self._queue:
                    waking = [r for r in self._ready_at if r > self.now]
                    if waking and min(waking) <= t:
                        self.now = min(waking)
                        continue
                    self.now = max(self.now, t)
                    return
                self._running = self._queue.popleft()
                self._started = self.now
            proc = self.processes[self._running]
            end = self._started + proc.kernel_s
            if end > t:
                self.now = max(self.now, t)
                return
            self.now = end
            self._busy[proc.container] += proc.kernel_s
            self.kernels_done[proc.container] += 1
            index, self._running = self._running, None
            self._outstanding[index] -= 1
            if proc.think_s > 0:
                self._ready_at[index] = self.now + proc.think_s
            else:
                self._refill(index)


def run(
    scheduler: GateScheduler,
    engine: EngineSim,
    duration: float,
    demand: Callable[[float], Set[str]],
    *,
    on_step: Callable[[float, Mapping[str, float]], None] | None = None,
) -> dict[str, float]:
    """Run scheduler and engine together for `duration` seconds; return busy time.

    `demand(t)` says which containers have work at time t (all their
    processes are then backlogged); it is sampled once per period.
    """
    period = scheduler.period
    steps = round(duration / period)
    for k in range(steps + 1):
        t = k * period
        engine.run_until(t)
        usage = engine.usage()
        if on_step is not None:
            on_step(t, usage)
        wants = demand(t)
        decision = scheduler.step(t, usage, wants)
        engine.set_demand(wants)
        engine.set_gates(decision.open)
    return engine.usage()
