"""The daemon's dispatchers: one thread per GPU hands the GPU to one container at a time.

A `Dispatcher` runs a `cgpu_km.sched.SliceScheduler` against a `GpuPort`:
it observes the containers (who waits at the gate, who launched, who
answered the last close), steps the scheduler, opens and closes gates, and
stamps the heartbeat; then it sleeps until the scheduler's deadline or
until a container rings its doorbell (a process starts waiting at the
gate, a watcher answers a close, or the holder goes idle). It never looks
without being rung: where the scheduler watches the holder for going idle
(`IdleWatch`: another container waits, or unused time stays idle), the
holder's processes are asked to say so themselves (libcgpu's watcher
reports when a process launched nothing for the grace and all it queued
has finished, and rings), and the dispatcher steps on that ring, at the
slice's end, or at the grace's end once every process said it is idle.
Each dispatcher is a plain thread of its own, so nothing else the daemon
does (tree reads, NVML, an OOM script, publishing) can delay a slice, a
drain or the heartbeat.

`RegionPort` is the port over the containers' regions; tests give a fake.
The dispatcher's figures (GPU seconds charged to each container, shares,
the holder) are read by the publishing service through `figures()`.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

from cgpu_km.dataplane import futex
from cgpu_km.dataplane.region import CONTENDED_QUEUE_NS, AccountLayout, Region
from cgpu_km.sched import (
    NOTHING,
    QUANTUM,
    GpuConfig,
    IdleWatch,
    Observation,
    Policy,
    ProcessRests,
    SliceDecision,
    SliceScheduler,
)
from cgpu_km.sched.grants import EVERYONE, GrantHistory, GrantLog
from cgpu_km.sched.slices import Draining, Holding, State

log = logging.getLogger("cgpu-daemon")

HEARTBEAT_NS = 500_000_000  # gates fail open when the heartbeat is 2 s old
# The heartbeat is stamped at any wake this close to its time, before or after
# (so at most 0.75 s apart, far from the 2 s). A wake for the heartbeat alone
# (nothing rang, nothing was configured, the scheduler's time has not come)
# stamps it without a step: a lone holder's renewals (every LONE_SLICE) are
# the only steps while nothing happens.
BEAT_SLACK_NS = 250_000_000
RING_LIMIT = 200  # rings a second a container may wake the dispatcher with ...
MUTE_NS = 50_000_000  # ... before its rings are not waited on for this long
IDLE_WAKE_NS = 1_000_000_000  # look again at least this often
# A drain's answer takes a ring or two per process. A holder whose rings woke the
# dispatcher this often in one drain is looked at every DRAIN_POLL_NS instead.
DRAIN_WAKES = 64
DRAIN_POLL_NS = 5_000_000
# Rings of a draining holder that one wait looks at (its slots only) before it
# wakes the dispatcher all the same: one per process, for most containers.
ANSWER_LOOKS = 8
# Waits in a row whose deadline had passed (the scheduler asked for another step
# at once, every time) before each such wait sleeps SPIN_PAUSE_NS all the same:
# a fault of the scheduler must not become a real-time thread that never sleeps.
SPIN_WAITS = 100
SPIN_PAUSE_NS = 1_000_000


# The kernel's name of a dispatcher thread (prctl PR_SET_NAME: 15 bytes at most),
# as `top -H` and /proc/PID/task/TID/comm show it.
THREAD_NAME = "cgpu-gpu{gpu}"
PR_SET_NAME = 15


def raise_priority(priority: int, gpu: int, *,
                   setscheduler: Callable[[int, int, os.sched_param], None] = os.sched_setscheduler,
                   ) -> str:
    """Name the calling thread for `gpu` and put it under SCHED_FIFO at `priority`
    (0: leave it under the default policy); what it runs under, in words.

    A dispatcher at the default policy competes with every busy process of the
    host, and a step the kernel runs late is a slice, a drain or a handover
    late. At the lowest real-time priority it preempts them when it wakes
    (it sleeps in futex waits, and takes a few percent of a core at most).
    Without the right to it (no CAP_SYS_NICE nor RLIMIT_RTPRIO, a seccomp
    filter) the thread stays as it is, and says so, in the journal too."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, THREAD_NAME.format(gpu=gpu).encode()[:15], 0, 0, 0)
    if priority == 0:
        return "default policy"
    try:  # a child it forked, if ever one, starts under the default policy
        setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(priority))
    except OSError as error:
        scheduling = f"default policy (SCHED_FIFO {priority} refused: {error.strerror})"
        log.warning("GPU %d: dispatcher under the %s", gpu, scheduling)
        return scheduling
    return f"SCHED_FIFO {priority}"


class GpuPort(Protocol):
    """One GPU's containers as its dispatcher sees and drives them."""

    def observe(self) -> Mapping[str, Observation]:
        """What each container shows now."""

    def apply(self, open_: frozenset[str], now_ns: int, queue_ns: int = 0,
              armed: frozenset[str] = frozenset(), watch: IdleWatch | None = None,
              close_at: tuple[str, int] | None = None) -> None:
        """Open the gates of `open_`, arm those of `armed` and close the others';
        `queue_ns`: the GPU time each process may keep queued (0: libcgpu's
        default); `watch`: ask its holder's processes to say when they go idle
        (a ring, and `Observation.active_at` after it); `close_at`: (the holder,
        ns) tell its processes when its slice ends."""

    def closes_at_end(self, name: str) -> bool:
        """Whether every process of `name` that answers closes stops by itself at
        the slice's end it was told and answers ahead (as of the last observe)."""

    def heartbeat(self, now_ns: int) -> None:
        """Tell every container that the daemon is alive."""

    def wait(self, deadline_ns: int, quiet: Set[str], holder: str | None,
             answers_of: str | None = None) -> str | None:
        """Sleep until the deadline or until something rings (`quiet`: those
        whose ring would tell nothing new); the container whose ring woke it.
        `answers_of`: a container whose drain answers are awaited; its rings
        wake the caller only once all have come (or after ANSWER_LOOKS of
        them)."""

    def kick(self) -> None:
        """Wake `wait` now (new configuration, new containers, stop)."""

    def open_all(self) -> None:
        """Open every gate (the daemon is going away: fail open)."""


@dataclass(frozen=True)
class Figures:
    """A dispatcher's figures at one instant."""

    used: Mapping[str, float]  # GPU seconds charged to each container so far
    shares: Mapping[str, Fraction]
    holder: str | None
    steps: int
    last_step: float  # time.monotonic() of the last step
    wakes: int = 0  # times its thread woke (a step, or a heartbeat alone)
    switches: int = 0  # grants to another holder than the last
    audits: Mapping[str, int] = field(default_factory=dict)  # quiet spans imposed, by container
    # The last new configuration: the steps taken when `configure` was handed it,
    # and the step that first ran with it.
    configured: tuple[int, int] = (0, 0)
    # How late its thread ran after the deadlines it slept to: (wake-ups at a
    # deadline, their lateness summed, the most), seconds. What a loaded host or
    # the interpreter's lock costs every step that rings cannot show.
    late: tuple[int, float, float] = (0, 0.0, 0.0)
    scheduling: str = ""  # the thread's scheduling policy, in words (`raise_priority`)
    moves: Mapping[str, int] = field(default_factory=dict)  # by row of the scheduler's table


def queue_budget(decision: SliceDecision, observed: Mapping[str, Observation],
                 late: Set[str]) -> int:
    """The GPU time each process may keep queued (0: libcgpu's default): less
    while more than one container wants the GPU (the holder, one that waits,
    one still draining), since what the holder queues is what the next one
    waits behind."""
    wanting = {n for n, seen in observed.items() if seen.waiting}
    wanting |= decision.open | late
    return CONTENDED_QUEUE_NS if len(wanting) > 1 else 0


class Dispatcher:
    """One GPU's scheduler in a thread of its own; `configure` from any thread."""

    def __init__(self, gpu: int, port: GpuPort, config: GpuConfig, *,
                 quantum: float = QUANTUM, clock: Callable[[], int] = time.monotonic_ns,
                 priority: int = 0) -> None:
        """`priority`: the SCHED_FIFO priority of its thread (0: the default policy)."""
        self.gpu = gpu
        self.priority = priority
        self.scheduling = ""
        self.port = port
        self.clock = clock
        self._lock = threading.Lock()
        self._scheduler = SliceScheduler(config, quantum=quantum)
        self._stop = threading.Event()
        self._decision: SliceDecision | None = None
        self._observed: Mapping[str, Observation] = {}
        self._steps = 0
        self._wakes = 0
        self._switches = 0
        self._last_holder: str | None = None
        self._last_step = time.monotonic()
        self._configured = False  # since the last step
        self._handed: tuple[int, GpuConfig] | None = None  # steps taken then, and it
        self._applied = (0, 0)  # Figures.configured
        self._grants = GrantLog(clock() / 1e9)  # who may run when, for the compute check
        self._audits: dict[str, int] = {}
        self._audit_wanted: dict[str, tuple[float, str]] = {}  # name -> (length, why)
        # The containers whose gates hold: their regions stamped by a heartbeat (a
        # gate fails open until then) and the scheduler configured with them.
        self._stamped: frozenset[str] = frozenset()
        self._launches: dict[str, int] = {}  # of those it armed, counted at the last step
        self._late = (0, 0.0, 0.0)  # Figures.late
        self.error: BaseException | None = None
        self.serving = threading.Event()  # its thread is named and at its priority

    @property
    def scheduler(self) -> SliceScheduler:
        return self._scheduler

    def configure(self, config: GpuConfig) -> None:
        """A new configuration (from the tree), applied at the next step."""
        with self._lock:
            if config != self._scheduler.config:
                self._scheduler.configure(config)
                self._configured = True
                self._handed = (self._steps, config)
        self.port.kick()

    def restore(self, state: Mapping[str, object]) -> None:
        with self._lock:
            self._scheduler.restore(state)

    def state(self) -> dict[str, object]:
        with self._lock:
            return self._scheduler.to_state()

    def figures(self) -> Figures:
        with self._lock:
            decision = self._decision
            return Figures(used=self._scheduler.used(),
                           shares=dict(decision.shares) if decision else {},
                           holder=decision.holder if decision else None,
                           steps=self._steps, last_step=self._last_step,
                           wakes=self._wakes, switches=self._switches,
                           audits=dict(self._audits), configured=self._applied,
                           late=self._late, scheduling=self.scheduling,
                           moves=self._scheduler.moves_by_row())

    def grants(self) -> GrantHistory:
        """Who might have run on the GPU when, as far as the dispatcher knows."""
        now = self.clock() / 1e9
        with self._lock:
            return self._grants.history(now)

    def stop(self) -> None:
        self._stop.set()
        self.port.kick()

    def step(self) -> SliceDecision:
        """One observe-decide-apply round (the thread's body; tests call it directly)."""
        # The clock first: what the observation shows happened by then or after,
        # and the grant log covers it from `now` (a launch between the two reads
        # would otherwise fall before the grant that lets it run).
        now = self.clock()
        observed = self._observed = self.port.observe()
        with self._lock:
            before = self._decision
            self._audit(now / 1e9, observed)
            config = self._scheduler.config
            decision = self._scheduler.step(now / 1e9, observed)
            self._decision = decision
            self._steps += 1
            if decision.holder not in (None, self._last_holder):
                self._switches += 1
                self._last_holder = decision.holder
            if self._handed is not None and self._handed[1] is config:
                self._applied, self._handed = (self._handed[0], self._steps), None
                log.info("GPU %d: a configuration handed over after step %d ran at step %d "
                         "(policy %d)", self.gpu, *self._applied, config.policy)
            self._last_step = time.monotonic()
            self._configured = False
            late = self._scheduler.late
            native = self._scheduler.config.policy is Policy.NATIVE
            holder = frozenset((decision.holder,)) if decision.holder is not None else frozenset()
            driven = self._stamped & observed.keys() & self._scheduler.config.containers.keys()
            self._grants.record(now / 1e9, EVERYONE if native else decision.open | late | holder,
                                driven=driven, armed=frozenset() if native else decision.armed,
                                launched=self._launched(before, observed))
            self._launches = {name: seen.launches for name in decision.armed
                              if (seen := observed.get(name)) is not None}
        close_at = None
        if decision.close_at is not None and decision.holder is not None:
            close_at = (decision.holder, math.ceil(decision.close_at * 1e9))
        self.port.apply(decision.open, now,
                        0 if native else queue_budget(decision, observed, late),
                        decision.armed, decision.idle_watch, close_at)
        if log.isEnabledFor(logging.DEBUG) and (before is None or before.open != decision.open):
            log.debug("GPU %d at %.4f: open %s (waiting %s; not answered %s)", self.gpu,
                      now / 1e9, ",".join(sorted(decision.open)) or "-",
                      ",".join(sorted(n for n, o in observed.items() if o.waiting)) or "-",
                      ",".join(sorted(n for n, o in observed.items() if not o.answered)) or "-")
        return decision

    def _wake_at(self, decision: SliceDecision, closes_at_end: bool) -> float:
        """When to step at the latest: the scheduler's time, but a watch for the
        holder going idle only once it said it is (it rings when it does), and
        the end of a slice only if its holder does not close itself then (it
        rings with its answer)."""
        watch = decision.idle_watch
        otherwise = decision.wake_at if watch is None else watch.otherwise
        if closes_at_end:
            otherwise = decision.close_wake
        if watch is None:
            return otherwise
        seen = self._observed.get(watch.holder, NOTHING)
        if seen.idle:
            return min(watch.at, otherwise)
        return otherwise

    def _closes_at_end(self, decision: SliceDecision) -> bool:
        """The holder was told its slice's end and closes itself then."""
        return (decision.close_at is not None and decision.holder is not None
                and self.port.closes_at_end(decision.holder))

    def audit(self, name: str, length: float, why: str) -> None:
        """Ask for an audit of `name` (`cgpu_km.sched.overuse`): a quiet span of
        `length` seconds, as soon as it waits while another holds the GPU."""
        with self._lock:
            self._audit_wanted[name] = (length, why)

    def _launched(self, before: SliceDecision | None,
                  observed: Mapping[str, Observation]) -> frozenset[str]:
        """Those the last step armed whose processes launched since (the grant log
        asks of no others; under the lock)."""
        armed = before.armed if before is not None else frozenset()
        return frozenset(name for name in armed if (seen := observed.get(name)) is not None
                         and seen.launches != self._launches.get(name, seen.launches))

    def _audit(self, now: float, observed: Mapping[str, Observation]) -> None:
        """Bar one container that an audit was asked for, if it waits while another
        holds the GPU and nobody is barred (under the lock)."""
        scheduler = self._scheduler
        wanted = self._audit_wanted
        if not wanted or scheduler.barred or scheduler.config.policy is Policy.NATIVE:
            return
        holder = scheduler.holder
        for name in sorted(wanted):
            if name not in scheduler.config.containers:
                del wanted[name]
            elif (holder is not None and name != holder and name not in scheduler.late
                    and observed.get(name, NOTHING).waiting):
                length, why = wanted.pop(name)
                scheduler.bar(name, now + length)
                self._audits[name] = self._audits.get(name, 0) + 1
                log.info("container %s on GPU %d: audited for %.2f s (%s)", name, self.gpu,
                         length, why)
                return

    def serve(self) -> None:
        """The body of the GPU's own thread: named, at its priority, `run`."""
        self.scheduling = raise_priority(self.priority, self.gpu)
        self.serving.set()
        self.run()

    def run(self) -> None:
        """Until `stop`: step, beat, sleep; on the way out every gate opens."""
        next_beat = 0
        # By the rings of the holder whose answer is awaited (in its drain, or at
        # the slice's end it closes itself at), in this slice or drain of it.
        drain_wakes = 0
        awaited: tuple[str, float] | None = None  # that slice or drain (`_span`)
        step_at = deadline = 0.0  # when the scheduler wants its next step; the wait's end
        ringer: str | None = None
        spinning = 0  # waits in a row whose deadline had passed
        try:
            while not self._stop.is_set():
                now = self.clock()
                with self._lock:
                    configured = self._configured
                # Woken early (a ring, a kick, an idle holder) or for the scheduler: a step.
                if ringer is not None or configured or now < deadline or now >= step_at:
                    decision = self.step()
                    closes_at_end = self._closes_at_end(decision)
                    now = self.clock()
                    step_at = min(self._wake_at(decision, closes_at_end) * 1e9,
                                  now + IDLE_WAKE_NS)
                if now >= next_beat - BEAT_SLACK_NS:
                    stamped = frozenset(self._observed)
                    self.port.heartbeat(now)
                    next_beat = now + HEARTBEAT_NS
                    with self._lock:
                        self._grants.alive(now / 1e9)
                        self._stamped = stamped
                with self._lock:
                    late, state = self._scheduler.late, self._scheduler.state
                draining = isinstance(state, Draining)
                # Rings that are answers: those of the holder while it drains or
                # closes itself at its slice's end (until it has rung too often in
                # that slice or drain: then it is polled), of those cut before they
                # answered, and of a holder watched for going idle. Anyone else
                # already seen waiting, or holding the GPU, tells nothing new by
                # ringing (a hostile one may ring without end).
                answering = set(late)
                if decision.idle_watch is not None:
                    answering.add(decision.idle_watch.holder)
                answers_of = None
                span = _span(state) if draining or closes_at_end else None
                if span != awaited:
                    awaited, drain_wakes = span, 0
                if awaited is not None and drain_wakes < DRAIN_WAKES:
                    answering.add(awaited[0])
                    answers_of = awaited[0]
                elif awaited is not None:  # rung too often: polled
                    step_at = min(step_at, now + DRAIN_POLL_NS)
                deadline = min(step_at, next_beat + BEAT_SLACK_NS)
                spinning = spinning + 1 if deadline <= now else 0
                if spinning >= SPIN_WAITS:
                    if spinning == SPIN_WAITS:
                        log.error("GPU %d: the scheduler asked for a step at once %d times "
                                  "in a row: pausing %g ms between such steps", self.gpu,
                                  SPIN_WAITS, SPIN_PAUSE_NS / 1e6)
                    deadline = now + SPIN_PAUSE_NS
                quiet = {n for n, seen in self._observed.items()
                         if (seen.waiting or n == decision.holder) and n not in answering}
                # Rounded up: a deadline a fraction of a nanosecond early is a step for nothing.
                ringer = self.port.wait(math.ceil(deadline), quiet, decision.holder,
                                        answers_of)
                self._wakes += 1  # a plain count: figures() may read it a wake late
                if ringer is None and (late_ns := self.clock() - deadline) >= 0:
                    count, total, most = self._late
                    self._late = (count + 1, total + late_ns / 1e9, max(most, late_ns / 1e9))
                if awaited is not None and ringer == awaited[0]:
                    drain_wakes += 1
        except BaseException as error:  # logged; the daemon's watchdog notices the silence
            self.error = error
            log.exception("GPU %d: dispatcher failed", self.gpu)
            raise
        finally:
            self.port.open_all()


def _span(state: State) -> tuple[str, float] | None:
    """A holder's slice or drain as its rings are counted: (holder, its start)."""
    if isinstance(state, Holding):
        return state.holder, state.slice_start
    if isinstance(state, Draining):
        return state.holder, state.closed_at
    return None


class RegionPort:
    """`GpuPort` over the regions of one GPU's containers."""

    def __init__(self, gpu: int) -> None:
        self.gpu = gpu
        # Replaced whole by `set_entries`, never changed in place: a dispatcher's
        # step reads them without the lock.
        self._entries: dict[str, tuple[Region, int]] = {}
        self._doorbells: dict[str, int] = {}  # addresses, fixed while a region is mapped
        self._looks: tuple[tuple[str, Region, int, ctypes.Array[ctypes.c_uint32],
                                 AccountLayout], ...] = ()
        self._rung: dict[str, int] = {}  # doorbell values at the last observation
        self._kick = ctypes.c_uint32(0)
        self._waits = futex.WaitSet()
        self._lock = threading.Lock()
        # What `apply` last wrote into each container's region: the region, and
        # (open, armed, queue_ns, idle grace, slice's end) in it.
        self._written: dict[str, tuple[Region, tuple[bool, bool, int, int, int]]] = {}
        # The last `apply`: its entries, (queue_ns, grace_ns), open, armed and
        # close_at (and `_watched`). The next one with the same entries and figures
        # writes only the gates whose want changed.
        self._applied: tuple[dict[str, tuple[Region, int]], tuple[int, int], frozenset[str],
                             frozenset[str], tuple[str, int] | None] | None = None
        self._rings: dict[str, collections.deque[int]] = {}
        self._muted_until: dict[str, int] = {}
        self._watched: str | None = None  # asked to say when it goes idle
        self._closers: frozenset[str] = frozenset()  # close themselves (at the last observe)
        self._rests = ProcessRests()

    def set_entries(self, entries: Mapping[str, tuple[Region, int]]) -> None:
        """The containers on this GPU: name -> (its region, its container GPU)."""
        doorbells = {name: region.doorbell_address(k) for name, (region, k) in entries.items()}
        looks = tuple((name, region, k, *region.quick_look())
                      for name, (region, k) in entries.items())
        with self._lock:
            self._entries = dict(entries)
            self._doorbells = doorbells
            self._looks = looks
        self.kick()

    def entries(self) -> dict[str, tuple[Region, int]]:
        with self._lock:
            return dict(self._entries)

    def observe(self) -> dict[str, Observation]:
        found: dict[str, Observation] = {}
        rung: dict[str, int] = {}
        closing: set[str] = set()
        watched = self._watched
        now = time.monotonic_ns() / 1e9
        for name, region, k, doorbells, account in self._looks:
            rung[name] = doorbells[k]
            # Most containers, most of the time: no process, two fields read.
            slots = region.live_slots() if account.slots_used else None
            if not slots:
                found[name] = NOTHING
                continue
            close_seq = region.close_seq(k)
            waiting = False
            launches = 0
            answered = True
            rest = 0.0
            idle_since = 0  # the latest of its processes' idle reports; -1: one is busy
            # Processes that answer closes; of them, those that close themselves at
            # the slice's end they are told, and those that answered the close to come.
            watchers = closers = ahead = 0
            for slot in slots:
                line = region.slot_gpu(slot, k)
                launches += line.launches
                if line.pending:
                    waiting = True
                rest = max(rest, self._rests.look((name, region.slot_pid(slot), slot),
                                                  int(line.launches), bool(line.pending), now))
                if line.watching:
                    watchers += 1
                    closers += line.closes_itself != 0
                    if line.drained_seq != close_seq:
                        answered = False
                        ahead += line.drained_seq == close_seq + 1
                    if idle_since >= 0:
                        idle_since = max(idle_since, line.idle_ns) if line.idle_ns else -1
            active_at = None
            idle = False
            if name == watched:  # its processes say whether they are idle
                idle = idle_since > 0 and not waiting
                active_at = idle_since / 1e9 if idle else now
            found[name] = Observation(waiting=waiting, launches=launches, answered=answered,
                                      active_at=active_at, process_rest=rest, idle=idle,
                                      closed_itself=0 < ahead == watchers
                                      and region.gate_is_open(k))
            if watchers and closers == watchers:
                closing.add(name)
        self._rests.end_round()
        self._rung = rung
        self._closers = frozenset(closing)
        return found

    def closes_at_end(self, name: str) -> bool:
        return name in self._closers


    def apply(self, open_: frozenset[str], now_ns: int, queue_ns: int = 0,
              armed: frozenset[str] = frozenset(), watch: IdleWatch | None = None,
              close_at: tuple[str, int] | None = None) -> None:
        entries = self._entries
        written = self._written
        if len(written) > len(entries):  # containers gone: forget them (and their maps)
            written = self._written = {n: w for n, w in written.items() if n in entries}
        watched = watch.holder if watch is not None and watch.holder in open_ else None
        grace_ns = int(watch.grace * 1e9) if watch is not None else 0
        last_watched, self._watched = self._watched, watched
        figures = (queue_ns, grace_ns)
        last, self._applied = self._applied, (entries, figures, open_, armed, close_at)
        names: Iterable[str] = entries
        if last is not None and last[0] is entries and last[1] == figures:
            changed = (open_ ^ last[2]) | (armed ^ last[3])
            changed |= {n for n in (watched, last_watched) if n is not None}
            changed |= {pair[0] for pair in (close_at, last[4]) if pair is not None}
            names = changed & entries.keys()
        ender, ends = close_at if close_at is not None and close_at[0] in open_ else (None, 0)
        for name in names:
            region, k = entries[name]
            is_open = name in open_
            want = (is_open, name in armed, queue_ns, grace_ns if name == watched else 0,
                    ends if name == ender else 0)
            was = written.get(name)
            if was == (region, want):
                continue  # most containers at most steps: only the holder's changes
            region.set_queue_ns(k, queue_ns)  # before a grant: the grantee starts tight
            region.set_idle_grace(k, want[3])  # before a grant: watched from its start
            if is_open:
                if (was is not None and was[0] is region and was[1][0]
                        and 0 < was[1][4] <= now_ns and was[1][4] != want[4]):
                    # Its slice's end has come and its processes may have answered
                    # ahead: that answer is for a close, so the slice goes on after one.
                    region.set_gate(k, False, now_ns)
                region.set_close_at(k, want[4])  # before the gate opens
            region.set_gate(k, is_open, now_ns, armed=want[1])
            written[name] = (region, want)

    def heartbeat(self, now_ns: int) -> None:
        for region, _k in self.entries().values():
            region.heartbeat(now_ns)

    def wait(self, deadline_ns: int, quiet: Set[str], holder: str | None,
             answers_of: str | None = None) -> str | None:
        """Until the deadline, a kick, or a ring of a container that is not quiet
        and, unless its drain answers are awaited, has not rung more than
        RING_LIMIT times in the last second (those are looked at when the
        dispatcher wakes for another reason); the container whose ring woke
        it. A ring of `answers_of` wakes the caller once
        every process of it has answered the latest close (each ring is a look
        at its slots, not a step over every container), or at its
        ANSWER_LOOKS-th ring."""
        now = time.monotonic_ns()
        words = [(ctypes.addressof(self._kick), self._kick.value, False)]
        names: list[str | None] = [None]
        with self._lock:
            doorbells = self._doorbells
        last_rung, muted = self._rung, self._muted_until
        for name, address in doorbells.items():
            seen = last_rung.get(name)
            if seen is None or name in quiet or (
                    muted and name != answers_of and muted.get(name, 0) > now):
                continue
            words.append((address, seen, True))
            names.append(name)
        woken = self._waits.wait(words, deadline_ns)
        with self._lock:
            drainer = self._entries.get(answers_of) if answers_of is not None else None
        looks = 1
        while (drainer is not None and 0 <= woken < len(names) and names[woken] == answers_of
               and looks < ANSWER_LOOKS):
            region, k = drainer
            # The ring after the answer: read the doorbell first, so that an answer
            # that comes after the look is a ring the next wait sees.
            rung = region.doorbell(k)
            if self._heard(region, k):
                break
            words[woken] = (words[woken][0], rung, True)
            woken = self._waits.wait(words, deadline_ns)
            looks += 1
        ringer = names[woken] if 0 <= woken < len(names) else None
        if ringer is not None and ringer != answers_of:
            rings = self._rings.setdefault(ringer, collections.deque())
            rings.append(now)
            while rings and now - rings[0] > 1_000_000_000:
                rings.popleft()
            if len(rings) > RING_LIMIT:
                self._muted_until[ringer] = now + MUTE_NS
        return ringer

    @staticmethod
    def _heard(region: Region, k: int) -> bool:
        """Whether every watching process of the container answered GPU k's latest
        close (as `observe` counts it); while its gate is open, whether each
        answered the close to come (it closed itself at its slice's end) or said
        it went idle: either is news for a step."""
        is_open = region.gate_is_open(k)
        close_seq = region.close_seq(k) + is_open
        for slot in region.live_slots():
            line = region.slot_gpu(slot, k)
            if line.watching and line.drained_seq != close_seq and not (is_open and line.idle_ns):
                return False
        return True

    def kick(self) -> None:
        self._kick.value = (self._kick.value + 1) & 0xFFFFFFFF
        futex.wake_private(ctypes.addressof(self._kick))

    def open_all(self) -> None:
        self._written = {}
        self._applied = None
        for region, k in self.entries().values():
            region.set_idle_grace(k, 0)
            region.set_close_at(k, 0)
            region.set_gate(k, True)
