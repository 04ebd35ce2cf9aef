"""The compute check's rules (pure): GPU time a container used, as the driver saw
it, against the spans in which the scheduler let it run.

libcgpu holds every launch at the container's gate, but code in a process can
step around it (a second copy of the driver, the driver's entry points read
from its symbol table). NVML samples each process's use of the GPU
(`nvmlDeviceGetProcessUtilization`: per sample period, the percent of the
period in which a kernel of that process ran), coarsely: a period is about
1/6 s, many turns long, and a process's figure may read up to about 1.4 times
what it ran (`simgpu` imitates both). So a container's use is weighed over a
window of several periods, all its processes together, against the seconds
in which it might have run (`cgpu_km.sched.grants`):

- over its grants: in the last `window` seconds its processes' samples add
  up to more than `tolerance` times the seconds it might have run, plus
  `slack` of the window. A cap (`util_limit`) is a bound on its grants, so
  the same rule holds it to its cap;
- outside its grants: samples of periods in which it might not have run at
  all (within a margin of a quarter period each side) add up to more than
  `outside_min` seconds. No factor makes use out of nothing, so this rule
  needs no tolerance.

The processes to stop are those whose use the gate did not hand out: first
those that launched nothing through the gate in the window (or whose
library found the driver's entry points taken), then the largest users,
until their use covers the excess. A process once judged is left out of
later windows.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Set
from dataclasses import dataclass, field

from cgpu_km.sched.grants import GrantHistory

__all__ = ["DEFAULT_PERIOD", "Judge", "Sample", "Verdict"]

Key = tuple[int, str]  # a container on a GPU, as cgpu_km.tree.views names it
DEFAULT_PERIOD = 1 / 6  # the shortest sample period NVML documents (the longest: 1 s)
MIN_PERIOD, MAX_PERIOD = 0.02, 1.0


@dataclass(frozen=True)
class Sample:
    """One NVML sample of one process, put in a container by the kernel's view:
    `percent` of the period that ended at `end` (seconds of the daemon's
    monotonic clock)."""

    key: Key
    pid: int
    end: float
    percent: int


@dataclass(frozen=True)
class Verdict:
    """A container that used the GPU beyond what it was granted, and who pays."""

    key: Key
    pids: tuple[int, ...]
    used: float  # GPU seconds its processes' samples add up to in the window
    allowed: float  # seconds in which it might have run
    window: float
    outside: float = 0.0  # of `used`, in periods in which it might not run at all

    def describe(self) -> str:
        if self.outside:
            return (f"used {self.outside:.2f} s of GPU time in the last {self.window:.1f} s "
                    f"while it held no grant (NVML per-process utilization)")
        return (f"used {self.used:.2f} s of GPU time in the last {self.window:.1f} s "
                f"while granted {self.allowed:.2f} s (NVML per-process utilization)")


@dataclass
class _Gpu:
    samples: collections.deque[Sample] = field(default_factory=collections.deque)
    last_end: dict[int, float] = field(default_factory=dict)  # pid -> its last sample's end
    spacings: collections.deque[float] = field(default_factory=lambda: collections.deque(
        maxlen=64))


class Judge:
    """Samples in, verdicts out; one per daemon, for every GPU."""

    def __init__(self, *, window: float = 2.0, tolerance: float = 1.5, slack: float = 0.05,
                 outside_min: float = 0.05) -> None:
        self.window = window
        self.tolerance = tolerance
        self.slack = slack
        self.outside_min = outside_min
        self._gpus: dict[int, _Gpu] = {}
        self._judged: set[tuple[Key, int]] = set()

    def periods(self, gpu: int) -> tuple[float, float]:
        """Bounds on NVML's sample period on `gpu`. Below: the shortest period NVML
        documents (1/6 s), or less when samples came closer, so that percents
        are never turned into more seconds than they were. Above: the shortest
        spacing of a process's samples (a multiple of the period: a process
        that rests skips periods), else the longest documented (1 s), so that a
        sample is never placed in less time than it covered."""
        found = self._gpus.get(gpu)
        upper = min(found.spacings) if found is not None and found.spacings else MAX_PERIOD
        upper = min(max(upper, MIN_PERIOD), MAX_PERIOD)
        return min(DEFAULT_PERIOD, upper), upper

    def add(self, gpu: int, samples: list[Sample]) -> None:
        """New samples of `gpu` (each read once: NVML's lastSeenTimeStamp)."""
        state = self._gpus.setdefault(gpu, _Gpu())
        for sample in sorted(samples, key=lambda s: s.end):
            before = state.last_end.get(sample.pid)
            if before is not None and sample.end - before >= MIN_PERIOD:
                state.spacings.append(sample.end - before)
            state.last_end[sample.pid] = sample.end
            state.samples.append(sample)

    def judge(self, gpu: int, now: float, grants: GrantHistory,
              launched_at: Mapping[tuple[Key, int], float | None],
              hijacked: Set[tuple[Key, int]] = frozenset()) -> list[Verdict]:
        """The containers of `gpu` over their grants in the window that ends a
        period before `now` (samples come up to a period late). `launched_at`:
        when each process's slot last counted a launch through the gate (None:
        never; a process with no slot is the bypass check's); `hijacked`: those
        whose libcgpu reported the driver's entry points taken."""
        state = self._gpus.get(gpu)
        if state is None:
            return []
        period, longest = self.periods(gpu)
        end = now - longest
        begin = end - self.window
        while state.samples and state.samples[0].end <= begin - self.window:
            state.samples.popleft()
        state.last_end = {pid: t for pid, t in state.last_end.items() if t > begin - self.window}
        used: dict[Key, dict[int, float]] = {}
        outside: dict[Key, dict[int, float]] = {}
        margin = longest / 4
        for sample in state.samples:
            if not begin < sample.end <= end or (sample.key, sample.pid) in self._judged:
                continue
            seconds = sample.percent / 100 * period
            mine = used.setdefault(sample.key, {})
            mine[sample.pid] = mine.get(sample.pid, 0.0) + seconds
            near = grants.allowed(sample.key[1], sample.end - longest - margin,
                                  sample.end + margin)
            if near == 0.0:
                out = outside.setdefault(sample.key, {})
                out[sample.pid] = out.get(sample.pid, 0.0) + seconds
        verdicts = []
        for key, by_pid in sorted(used.items()):
            allowed = grants.allowed(key[1], begin - longest, end)
            if allowed is None:
                continue  # the gates may have failed open, or nothing is known yet
            total = sum(by_pid.values())
            out = outside.get(key, {})
            if sum(out.values()) > self.outside_min:
                verdict = Verdict(key, tuple(sorted(out)), total, allowed, self.window,
                                  outside=sum(out.values()))
            else:
                excess = total - self.tolerance * allowed - self.slack * self.window
                if excess <= 0:
                    continue
                pids = self._culprits(key, by_pid, excess, begin, launched_at, hijacked)
                verdict = Verdict(key, pids, total, allowed, self.window)
            self._judged.update((key, pid) for pid in verdict.pids)
            verdicts.append(verdict)
        self._judged = {(key, pid) for key, pid in self._judged
                        if (key, pid) in launched_at or any(
                            s.key == key and s.pid == pid for s in state.samples)}
        return verdicts

    @staticmethod
    def _culprits(key: Key, by_pid: Mapping[int, float], excess: float, begin: float,
                  launched_at: Mapping[tuple[Key, int], float | None],
                  hijacked: Set[tuple[Key, int]]) -> tuple[int, ...]:
        """The processes whose use the gate did not hand out, first, then the
        largest, until their use covers `excess`."""
        def suspect(pid: int) -> bool:
            at = launched_at.get((key, pid))
            return (key, pid) in hijacked or at is None or at < begin

        chosen: list[int] = []
        covered = 0.0
        for pid in sorted(by_pid, key=lambda p: (not suspect(p), -by_pid[p], p)):
            if covered >= excess:
                break
            chosen.append(pid)
            covered += by_pid[pid]
        return tuple(sorted(chosen))
