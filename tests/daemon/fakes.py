"""In-memory stand-ins for the daemon's edges: a control tree and a data plane.

`MemoryTree` holds a tree in memory with the daemon-facing operations of
`cgpu_km.daemon.edges.Tree`; `FakePlane` records what the daemon asks of the
data plane (configurations, limits, stops) and returns the memory figures a
test sets; `FakeWatcher` stands for inotify (a pipe). `FakeTarget` and
`FakeScript` stand for a process pinned for a stop and its OOM script, in
the trio clock where there is one; `forged_region` is a real region whose
process slots a test writes as libcgpu would. Nothing else here touches the
system; trio's mock clock works.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Mapping, Set
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import trio

from cgpu_km.dataplane import region as region_mod
from cgpu_km.dataplane.attribution import ContainerMemory, MemoryView
from cgpu_km.dataplane.dispatch import Figures
from cgpu_km.dataplane.stopping import ScriptResult
from cgpu_km.dataplane.usage import UsageView
from cgpu_km.sched import GpuConfig
from cgpu_km.tree.client import ContainerView, GpuView
from cgpu_km.tree.views import Change, ContainerNodes, GpuNodes, Key, QuickView


@contextlib.contextmanager
def forged_region(base: Path, name: str, slots: int
                  ) -> Iterator[tuple[region_mod.Region, list[region_mod.ProcSlot]]]:
    """Container `name`'s region on one GPU under `base`, open, with its first
    `slots` process slots live as libcgpu's claims leave them (pids 1 to
    `slots`; the test writes the rest of each slot)."""
    region_mod.Region.create(region_mod.region_path(name, base), name,
                             [region_mod.GpuSpec(0, "", 0, 0)]).close()
    with region_mod.Region.open(region_mod.region_path(name, base)) as region:
        claimed = [region._account.proc[i] for i in range(slots)]
        for pid, slot in enumerate(claimed, start=1):
            slot.state, slot.pid = region_mod.SLOT_LIVE, pid
        region._account.slots_used = slots
        yield region, claimed


def answering_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


class FakeWatcher:
    """A watcher a test speaks for: `say` queues changes and makes it readable."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        self._queued: list[Change] = []
        self.syncs = 0

    def say(self, *changes: Change) -> None:
        self._queued.extend(changes)
        os.write(self._write, b"!")

    def fileno(self) -> int:
        return self._read

    def sync(self, gpus: Mapping[int, GpuNodes]) -> None:
        self.syncs += 1  # nothing to watch: the test says what changed

    def changes(self) -> list[Change]:
        os.read(self._read, 4096)
        found, self._queued = self._queued, []
        return found

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


@dataclass
class MemoryTree:
    """A control tree in memory: edit `gpus` directly, as an operator's `echo` would."""

    gpus: list[GpuView] = field(default_factory=list)
    upgrade: int = 0
    fail: bool = False  # reads raise OSError (tree unmounted)
    # Cleared by `wedge`: every read and write blocks (a wedged FUSE mount).
    answering: threading.Event = field(default_factory=answering_event)
    meminfo_writes: list[tuple[int, str, dict[int, int]]] = field(default_factory=list)
    reads: int = 0
    watching: FakeWatcher | None = None  # what `watcher` gives (None: no inotify)

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

    def wedge(self, wedged: bool = True) -> None:
        if wedged:
            self.answering.clear()
        else:
            self.answering.set()

    def _check(self) -> None:
        self.answering.wait(timeout=10)  # a daemon that waits for it fails, not hangs
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

    def watcher(self) -> FakeWatcher | None:
        return self.watching



class FakePlane:
    """What the daemon asked of the data plane, and the memory a test says there is."""

    def __init__(self) -> None:
        self.attached: dict[int, set[str]] = {}
        self.configs: dict[int, GpuConfig] = {}
        self.restored: dict[int, Mapping[str, Any]] = {}
        self.limits: dict[Key, int] = {}
        self.memory_by: dict[Key, dict[int, int]] = {}
        self.unmanaged: dict[Key, set[int]] = {}
        self.egpu_keys: set[Key] = set()
        self.stopped: list[tuple[Key, int]] = []  # each SIGKILL
        self.stopped_with_script: list[bool] = []  # each SIGKILLed target's oom_script
        self.stops_held: threading.Event | None = None  # a slow pin ends when this is set
        self.stops_begun = 0  # pins asked for
        self.oom_scripts: dict[Key, str] = {}  # eGPU containers' OOM scripts
        self.script_seconds: float | None = 0.0  # how long a script runs (None: until killed)
        self.script_status = 0
        self.script_output = b""
        self.unkillable: set[int] = set()  # pids that stay after SIGKILL
        self.events: list[tuple[float, str, Key, int]] = []  # (when, what, key, pid)
        self.stuck = False  # dispatchers stopped stepping
        self.closed = False
        self.used: dict[int, dict[str, float]] = {}
        self.missing_names: set[str] = set()
        self.attaches = 0
        self.missing_looks = 0
        self.reclaims = 0
        self.audits: list[tuple[Key, float]] = []
        self._lock = threading.Lock()

    def attach(self, containers: Mapping[int, Set[str]]) -> bool:
        self.attached = {gpu: set(names) for gpu, names in containers.items()}
        self.attaches += 1
        return True

    def missing(self) -> set[str]:
        self.missing_looks += 1
        return set(self.missing_names)

    def schedule(self, gpu: int, config: GpuConfig, state: Mapping[str, Any] | None) -> None:
        self.configs[gpu] = config
        if state is not None:
            self.restored[gpu] = state

    def forget_gpu(self, gpu: int) -> None:
        self.configs.pop(gpu, None)

    def set_limit(self, key: Key, limit: int) -> None:
        self.limits[key] = limit

    def egpu(self, key: Key) -> bool:
        return key in self.egpu_keys

    def figures(self) -> dict[int, Figures]:
        return {gpu: Figures(used=self.used.get(gpu, {}),
                             shares={n: Fraction(1, len(c.containers) or 1)
                                     for n in c.containers},
                             holder=None, steps=1,
                             last_step=0.0 if self.stuck else time.monotonic())
                for gpu, c in self.configs.items()}

    def scheduler_state(self, gpu: int) -> dict[str, Any]:
        return {"accounts": {n: {"credit": 0.5, "cap_credit": 0.0, "used": 1.0}
                             for n in self.configs[gpu].containers}}

    def ticking(self, within: float) -> bool:
        return not self.stuck

    def memory(self) -> MemoryView:
        with self._lock:
            return MemoryView(by_container={
                key: ContainerMemory(dict(procs),
                                     frozenset(self.unmanaged.get(key, set()) & procs.keys()))
                for key, procs in self.memory_by.items()})

    def audit(self, key: Key, length: float, why: str) -> None:
        self.audits.append((key, length))

    def usage(self) -> UsageView:
        return UsageView(time.monotonic(), {})

    def reclaim(self) -> int:
        self.reclaims += 1
        return 0

    def target(self, key: Key, pid: int, *, oom_script: bool = True) -> FakeTarget | None:
        with self._lock:
            self.stops_begun += 1
        if self.stops_held is not None:
            self.stops_held.wait()
        with self._lock:
            if pid not in self.memory_by.get(key, {}):
                return None
            script = self.oom_scripts.get(key, "") if oom_script and key in self.egpu_keys \
                else ""
            self.record("pin", key, pid)
            return FakeTarget(self, key, pid, script, oom_script)

    def record(self, what: str, key: Key, pid: int) -> None:
        self.events.append((now(), what, key, pid))

    def times(self, what: str, pid: int) -> list[float]:
        """When each `what` of `pid` happened."""
        return [at for at, name, _key, p in self.events if name == what and p == pid]

    def close(self) -> None:
        self.closed = True


def now() -> float:
    """The trio clock (mock time in tests) where there is one, else the monotonic clock."""
    try:
        return trio.current_time()
    except RuntimeError:
        return time.monotonic()


class FakeScript:
    """An OOM script that ends `plane.script_seconds` after it started (never: None)."""

    def __init__(self, target: FakeTarget) -> None:
        self.target = target
        self.started = now()
        self.killed = False

    def ended(self) -> bool:
        seconds = self.target.plane.script_seconds
        return not self.killed and seconds is not None and now() - self.started >= seconds

    def kill(self) -> None:
        self.killed = True

    def end(self) -> ScriptResult:
        plane = self.target.plane
        ended = self.ended()
        self.killed = True
        plane.record("script end", self.target.key, self.target.pid)
        output = plane.script_output
        return ScriptResult(plane.script_status if ended else None, output[-1024:],
                            len(output), "")


class FakeTarget:
    """A process of a `FakePlane` pinned for a stop."""

    def __init__(self, plane: FakePlane, key: Key, pid: int, oom_script: str,
                 asked_script: bool) -> None:
        self.plane = plane
        self.key = key
        self.pid = pid
        self.oom_script = oom_script
        self.asked_script = asked_script
        self.killed = False
        self.closed = False

    def freeze(self) -> None:
        self.plane.record("freeze", self.key, self.pid)

    def kill(self) -> None:
        plane = self.plane
        plane.record("kill", self.key, self.pid)
        self.killed = True
        with plane._lock:
            plane.stopped.append((self.key, self.pid))
            plane.stopped_with_script.append(self.asked_script)
            if self.pid not in plane.unkillable:
                plane.memory_by.get(self.key, {}).pop(self.pid, None)

    def gone(self) -> bool:
        return self.killed and self.pid not in self.plane.unkillable

    def start_script(self, timeout: float) -> FakeScript:
        self.plane.record("script", self.key, self.pid)
        return FakeScript(self)

    def close(self) -> None:
        self.closed = True
