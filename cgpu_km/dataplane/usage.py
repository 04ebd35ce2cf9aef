"""GPU time by process as the driver saw it, put in containers by the kernel's view.

The compute check (`cgpu_km.daemon.overuse`) weighs these samples against the
dispatchers' grants. Read here: NVML's per-process utilization samples newer
than the last read (each once), their times moved onto the daemon's monotonic
clock, their host pids put in containers the way the memory round does; and,
from each container's account, when each process last launched through the
gate (its slot's counter, compared between reads) and whether its libcgpu
found the driver's entry points taken by someone else.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from cgpu_km.dataplane import kernelview
from cgpu_km.dataplane.attribution import Attribution, Nvml
from cgpu_km.dataplane.registry import Attached, Registry
from cgpu_km.sched.grants import GrantHistory
from cgpu_km.sched.overuse import Sample
from cgpu_km.tree.views import Key

Identity = tuple[int, int, int]  # (pid namespace, pid in it, start time)
KNOWN_FOR = 10.0  # seconds a process's slot figures are kept after it was last seen
OFFSET_TRIES = 4  # bracketed reads of the two clocks, at most
OFFSET_TIGHT = 0.0002  # seconds: a bracket this narrow needs no other try


def clock_offset(monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> float:
    """The wall clock's lead on the monotonic clock, from the narrowest of a few
    reads of the wall clock between two of the monotonic one. A thread
    stopped between two plain reads (a starved host, another thread taking
    the GIL) would date every sample of the round that much early, and the
    check would weigh it against grants it did not run in."""
    width, offset = math.inf, 0.0
    for _ in range(OFFSET_TRIES):
        before = monotonic()
        at = wall()
        after = monotonic()
        if after - before < width:
            width, offset = after - before, at - (before + after) / 2
        if width <= OFFSET_TIGHT:
            break
    return offset


@dataclass(frozen=True)
class GpuUsage:
    """One GPU's new samples, its grants, and its processes' gate launches."""

    samples: list[Sample]
    grants: GrantHistory
    launched_at: Mapping[tuple[Key, int], float | None] = field(default_factory=dict)
    hijacked: frozenset[tuple[Key, int]] = frozenset()


@dataclass(frozen=True)
class UsageView:
    now: float  # the daemon's monotonic clock, seconds
    gpus: Mapping[int, GpuUsage]


class UsageReader:
    """What `RegionPlane.usage` reads each round, with what it remembers between rounds."""

    def __init__(self, registry: Registry, nvml: Nvml, attribution: Attribution) -> None:
        self.registry = registry
        self.nvml = nvml
        self.attribution = attribution
        self._last_seen: dict[int, int] = {}  # gpu -> newest sample timestamp read (us)
        self._read: dict[int, set[tuple[int, int]]] = {}  # gpu -> (pid, timestamp) read
        self._launches: dict[tuple[Key, Identity], tuple[int, float]] = {}
        # What the slots said of each process, kept a while after its slot is gone:
        # its samples outlive it in the check's window.
        self._known: dict[tuple[Key, int], tuple[float | None, bool, float]] = {}

    def read(self, grants_of: Callable[[], Mapping[int, GrantHistory]]) -> UsageView:
        """The samples since the last read, then the grants (`grants_of`), which
        must cover them. The kernel and the regions are asked only about the
        containers that have samples (most of them, most of the time, have none)."""
        # Samples may be published a little out of order: ask again for the last
        # second's, and keep only those not read before.
        since = {gpu: max(0, seen - 1_000_000) for gpu, seen in self._last_seen.items()}
        found = self.nvml.utilization_by_pid(since)
        now = time.monotonic()
        offset = clock_offset()  # NVML dates samples by the wall clock, in microseconds
        grants = grants_of()
        fresh = {gpu: self._fresh(gpu, found.get(gpu, ())) for gpu in grants}
        samples: dict[int, list[Sample]] = {gpu: [] for gpu in grants}
        if any(fresh.values()):
            keys = self.registry.keys()
            owners = self.registry.owner_index(keys, self.attribution.host,
                                               self.attribution.proc)
            attributed: list[tuple[Key, int, Identity]] = []
            infos: dict[int, kernelview.ProcessInfo | None] = {}  # this round's, by pid
            for gpu, rows in fresh.items():
                for pid, stamp, percent in rows:
                    if pid not in infos:  # a process has several samples a round
                        infos[pid] = self.attribution.known_info(pid)
                    info = infos[pid]
                    name = owners.find(info) if info is not None else None
                    key = (gpu, name or "")
                    if info is None or name is None or key not in keys:
                        continue
                    samples[gpu].append(Sample(key, pid, stamp / 1e6 - offset, percent))
                    attributed.append((key, pid, (info.pidns, info.inner_pid,
                                                  info.start_time)))
            slots = self._slots({key: keys[key] for key, _pid, _id in attributed}, now)
            for key, pid, identity in attributed:
                if (key, identity) in slots:
                    self._known[key, pid] = (*slots[key, identity], now)
        self._known = {found: seen for found, seen in self._known.items()
                       if now - seen[2] < KNOWN_FOR}
        gpus: dict[int, GpuUsage] = {}
        for gpu, history in grants.items():
            known = {found: seen for found, seen in self._known.items() if found[0][0] == gpu}
            gpus[gpu] = GpuUsage(
                samples[gpu], history, {found: at for found, (at, _h, _t) in known.items()},
                frozenset(found for found, (_at, flagged, _t) in known.items() if flagged))
        return UsageView(now, gpus)

    def _fresh(self, gpu: int, rows: Sequence[tuple[int, int, int]]
               ) -> list[tuple[int, int, int]]:
        """The (pid, timestamp, percent) samples of `gpu` not read before."""
        read = self._read.setdefault(gpu, set())
        fresh = [(pid, stamp, percent) for pid, stamp, percent in rows
                 if (pid, stamp) not in read]
        if fresh:
            self._last_seen[gpu] = max(self._last_seen.get(gpu, 0),
                                       *(stamp for _pid, stamp, _ in fresh))
            read.update((pid, stamp) for pid, stamp, _ in fresh)
            newest = self._last_seen[gpu]
            self._read[gpu] = {(pid, stamp) for pid, stamp in read
                               if stamp > newest - 2_000_000}
        return fresh

    def _slots(self, keys: Mapping[Key, tuple[Attached, int]], now: float
               ) -> dict[tuple[Key, Identity], tuple[float | None, bool]]:
        """Per live slot: when its gate launches last grew (None: it has launched
        none), and whether its libcgpu flagged the driver's entry points."""
        found: dict[tuple[Key, Identity], tuple[float | None, bool]] = {}
        counts = {known: counted for known, counted in self._launches.items()
                  if now - counted[1] < KNOWN_FOR}
        for key, (entry, k) in keys.items():
            region = entry.region
            if not region.live_slots():
                continue
            for view in region.processes():
                identity = (view.pidns, view.pid, view.start_time)
                launches = view.launches[k]
                before = self._launches.get((key, identity))
                at = now if before is None or before[0] != launches else before[1]
                counts[key, identity] = (launches, at)
                found[key, identity] = (at if launches else None, view.hijacked > 0)
        self._launches = counts
        return found
