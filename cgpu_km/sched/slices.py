"""Exclusive time slices: who holds a GPU, for how long, from the shares and measured time.

One `SliceScheduler` per GPU. Under policies 0-4 one container's work runs
on the GPU at a time: the scheduler grants a container the GPU (its gate
opens) for a slice, then ends the slice (its gate closes) and waits until
the container's processes say that the work they queued before the close
has finished (their drain answers); only then is the next container
granted. What a holder is charged is the time from its grant until its
last drain answer is seen: GPU time measured by the data plane's own
markers, whatever ran past the slice's end and the answer's way back
included (no time is owed to nobody, so a container cannot make the others
pay for its switches). The caller (the daemon's dispatcher thread, or a
simulation in tests) calls `step(now, observations)` whenever
something may have changed and at the latest at the time the answer names.
No I/O and no clock here.

Accounting: each container has a share credit (accrues ``share * dt`` of
wall time, pays for the GPU time it held) and a cap credit for
``util_limit`` (accrues ``cap * dt``, never forgiven). The next holder is
the waiting container owed the most (a preempting one first), among those
whose credits are not negative; when none is, the GPU stays idle until one
is (that is how shares below 1 hold under policies 0, 2 and 3). Positive
credit is clamped to a short burst while a container is idle (no banking). A
lone busy holder keeps the GPU without a drain: its slice is renewed while
nobody else waits and its credit allows.

Handovers, for latency: a container that starts waiting after a rest (it
had neither launched, waited nor held the GPU for half a quantum) and is
eligible takes the GPU from its holder at once, instead of after the
holder's slice and drain. The holder's gate closes and it is late until it
answers (not granted before, charged until then, cut at its drain limit as
any holder); the driver time-slices the two meanwhile, and that shared span
is paid half by each. A busy container waiting on past its own turn never
rests, so between busy containers slices and drains are as above; at most
MAX_OVERLAP handover drains run at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from cgpu_km.sched.allotments import GpuConfig, Policy, allotments

__all__ = ["QUANTUM", "Observation", "SliceDecision", "SliceScheduler"]


@dataclass(frozen=True)
class Observation:
    """What the data plane shows of one container on one GPU at one instant."""

    waiting: bool = False  # some process waits for the GPU (at the gate, or for its own work)
    launches: int = 0  # launches so far (compared between steps)
    answered: bool = True  # every process that launched answered the latest close
    # The latest of those answers' own drain times: for the log only, never charged
    # on (a process may date its answer as it likes).
    drained_at: float = 0.0


@dataclass(frozen=True)
class SliceDecision:
    """The gates that are open until the next step, and when to step again at the latest."""

    open: frozenset[str]
    holder: str | None
    wake_at: float
    shares: Mapping[str, Fraction] = field(default_factory=dict)

    def is_open(self, name: str) -> bool:
        return name in self.open


@dataclass
class _Account:
    credit: float = 0.0
    cap_credit: float = 0.0
    used: float = 0.0  # GPU seconds charged so far
    last_launches: int | None = None
    last_active: float = -float("inf")
    drain_limit: float = float("inf")  # how long its drain may take before it is cut
    last_waiting: float = -float("inf")  # the last step that saw it waiting
    # How long it had neither launched nor waited when its present wait began; 0
    # while it waits on past the end of a turn.
    rested: float = 0.0


NEVER = float("inf")
# The default quantum: the slice of the smallest share. Each switch costs the
# holder its drain answer's way back, so the shorter the quantum the more that
# costs (and the more unequal slices skew the ratios); the longer, the more a
# short window's share swings (`python -m tests.bench --slice 0.01` shows both).
QUANTUM = 0.02
MAX_QUANTA = 4.0  # the longest slice, in quanta
ELIGIBLE_SLACK_QUANTA = 0.25  # how far behind in share credit a container may start
REST_QUANTA = 0.5  # how long a container must rest before it may wake into the GPU
# Handovers whose drains may overlap the holder at once (a chain of waking
# containers: each earlier drainer pays in full once its successor's turn ends).
MAX_OVERLAP = 2
# A holder alone with the whole GPU is looked at this often (a container that
# starts waiting rings, and is looked at at once).
LONE_SLICE = 0.25


class SliceScheduler:
    """Exclusive time slices on one GPU, driven by `step` (pure)."""

    def __init__(
        self,
        config: GpuConfig,
        *,
        quantum: float = QUANTUM,
        idle_grace: float = 0.002,
        drain_timeout: float = 0.5,
        burst_quanta: float = 2.0,
    ) -> None:
        for name, value in (("quantum", quantum), ("idle_grace", idle_grace),
                            ("drain_timeout", drain_timeout), ("burst_quanta", burst_quanta)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, not {value}")
        self.quantum = quantum
        self.idle_grace = idle_grace
        self.drain_timeout = drain_timeout
        self._drain_floor = min(drain_timeout, quantum * MAX_QUANTA)
        self.burst_window = quantum * burst_quanta
        self._config = config
        self._accounts: dict[str, _Account] = {n: _Account() for n in config.containers}
        self._now: float | None = None
        self._active: frozenset[str] = frozenset()
        self.holder: str | None = None
        self._granted_at = 0.0
        self._slice_end = 0.0
        self._closed_at: float | None = None  # the holder's slice ended: draining
        self._late: dict[str, float] = {}  # cut before it answered: charged up to
        # Handed over to a waking container before it answered: its drain's deadline
        # (these are in _late too).
        self._overlap: dict[str, float] = {}
        # A handover's holder shares the GPU with the drain it overlaps: that span
        # (the drainer, its start) is paid half by each, so the holder is not
        # charged at its own rate until `_free_until` (infinity while it lasts).
        self._shared: tuple[str, float] | None = None
        self._free_until: float | None = None
        self._refund: dict[str, float] = {}  # a drainer's half of what it shared
        self._now_before = -NEVER  # the step before this one
        self._native_open: frozenset[str] = frozenset()
        self._set_allot()

    @property
    def config(self) -> GpuConfig:
        return self._config

    def configure(self, config: GpuConfig) -> None:
        """Apply a new configuration; it takes effect at the next step.

        Containers keep their accounts unless the policy changed (then every
        credit starts afresh so that the new policy holds at once)."""
        fresh = config.policy != self._config.policy
        accounts: dict[str, _Account] = {}
        for name in config.containers:
            old = self._accounts.get(name)
            if old is None:
                accounts[name] = _Account()
            elif fresh:
                accounts[name] = _Account(used=old.used, last_launches=old.last_launches)
            else:
                accounts[name] = old
        self._accounts = accounts
        self._config = config
        self._active = self._active & frozenset(config.containers)
        self._late = {n: t for n, t in self._late.items() if n in accounts}
        self._overlap = {n: t for n, t in self._overlap.items() if n in accounts}
        self._refund = {n: t for n, t in self._refund.items() if n in accounts}
        if self._shared is not None and self._shared[0] not in accounts:
            self._shared = None
        if self.holder is not None and self.holder not in accounts:
            self.holder, self._closed_at, self._free_until, self._shared = None, None, None, None
        self._set_allot()

    def credits(self) -> dict[str, float]:
        """Share credit per container in seconds (negative: owes GPU time)."""
        return {n: a.credit for n, a in self._accounts.items()}

    def used(self) -> dict[str, float]:
        """GPU seconds charged to each container so far (its measured GPU time)."""
        return {n: a.used for n, a in self._accounts.items()}

    @property
    def late(self) -> frozenset[str]:
        """Containers cut before they answered a close: their answers are awaited."""
        return frozenset(self._late)

    @property
    def draining(self) -> bool:
        return self._closed_at is not None

    def _set_allot(self) -> None:
        self._allot = allotments(self._config, self._active)
        self._shares: dict[str, Fraction] = {n: a.share for n, a in self._allot.items()}
        self._rates: dict[str, tuple[float, float]] = {
            n: (float(a.share), float(a.cap)) for n, a in self._allot.items()
        }

    def _charge(self, name: str, seconds: float) -> None:
        acc = self._accounts.get(name)
        if acc is not None and seconds > 0:
            acc.credit -= seconds
            acc.cap_credit -= seconds
            acc.used += seconds

    def step(self, now: float, observed: Mapping[str, Observation]) -> SliceDecision:
        """Account the time since the last step and decide who holds the GPU now."""
        dt = 0.0 if self._now is None else now - self._now
        if dt < 0:
            raise ValueError(f"time went backwards: {now} < {self._now}")
        self._now = now
        nothing = Observation()
        for name, acc in self._accounts.items():
            seen = observed.get(name, nothing)
            if seen.waiting:
                if acc.last_waiting < self._now_before or acc.last_waiting == -NEVER:
                    acc.rested = now - acc.last_active  # a wait begins
                acc.last_waiting = now
            if seen.waiting or (acc.last_launches is not None
                                and seen.launches != acc.last_launches):
                acc.last_active = now
            acc.last_launches = seen.launches
        self._now_before = now
        self._accrue(dt)
        for name, charged_to in list(self._late.items()):
            acc = self._accounts[name]
            if observed.get(name, nothing).answered:
                if self._overlap.pop(name, None) is not None:  # answered in time
                    acc.drain_limit = min(2 * self._drain_limit(name), self.drain_timeout)
                    self._end_shared(now)
                self._charge(name, now - charged_to - self._refund.pop(name, 0.0))
                del self._late[name]
            elif name in self._overlap and now >= self._overlap[name]:
                del self._overlap[name]  # cut: it stays late
                acc.drain_limit = max(self._drain_limit(name) / 2, self._drain_floor)
                self._end_shared(now)
        # Active: waiting now, or launched or waited within a short while (a busy
        # container's processes are not at the gate every instant: between two
        # turns they drain, wake, launch).
        active = frozenset(n for n, acc in self._accounts.items()
                           if observed.get(n, nothing).waiting
                           or now - acc.last_active < self.burst_window)
        if active != self._active:
            self._active = active
            self._set_allot()
        if self._config.policy is Policy.NATIVE:
            return self._native(now, dt)
        return self._exclusive(now, observed)

    def _accrue(self, dt: float) -> None:
        for name, acc in self._accounts.items():
            share, cap = self._rates[name]
            acc.credit += share * dt
            acc.cap_credit += cap * dt
            if name not in self._active and name != self.holder:
                # idle: no banking beyond a short burst
                acc.credit = min(acc.credit, share * self.burst_window)
                acc.cap_credit = min(acc.cap_credit, cap * self.burst_window)

    def _eligible(self, name: str, slack: float | None = None) -> bool:
        """May start a slice: its credits are not below zero, give or take a
        little (`slack`, by default a quarter quantum of share credit: a
        container just behind is not left waiting a whole slice for it)."""
        acc = self._accounts[name]
        if slack is None:
            slack = self.quantum * ELIGIBLE_SLACK_QUANTA
        return (self._rates[name][0] > 0 and acc.credit >= -slack
                and acc.cap_credit >= -1e-9)

    def _waking(self, waiting: Set[str]) -> set[str]:
        """Those that may take the GPU from its holder at once: eligible (share
        credit not below a quarter quantum's), waiting after a rest of half a
        quantum (neither launching, waiting nor holding the GPU: a busy
        container whose processes come back to the gate late after its turn,
        on a loaded host, is not waking), and of the holder's priority or
        higher."""
        holder = self.holder
        if holder is None or len(self._overlap) >= MAX_OVERLAP:
            return set()
        prio = self._allot[holder].preempts
        return {n for n in waiting
                if n != holder and self._accounts[n].rested >= self.quantum * REST_QUANTA
                and self._eligible(n) and (self._allot[n].preempts or not prio)}

    def _hand_over(self, now: float) -> None:
        """The holder's gate closes and the GPU goes to a waking container at once:
        the driver time-slices the two while the holder drains. The holder is
        charged until its answer is seen (it is late until then); the next one
        from then on (the overlap is the cost of what the holder had queued)."""
        holder = self.holder
        assert holder is not None
        closed = self._closed_at if self._closed_at is not None else now
        self._charge_holder(now)
        self._late[holder] = now
        self._overlap[holder] = closed + self._drain_limit(holder)
        self._release(now)
        self._shared, self._free_until = (holder, now), NEVER

    def _end_shared(self, now: float) -> None:
        """The span in which a handover's holder and the drain it overlaps shared the
        GPU has ended (the drainer answered or was cut, or the holder's turn ended):
        each pays half of it, as the driver's time slicing gives each about half."""
        if self._shared is None:
            return
        drainer, start = self._shared
        half = (now - start) / 2
        self._refund[drainer] = self._refund.get(drainer, 0.0) + half
        if self.holder is not None:
            self._charge(self.holder, half)
        self._shared, self._free_until = None, now

    def _charge_holder(self, now: float) -> None:
        """Charge the holder up to `now` since it was last charged (none of a
        handover's overlap), and count on from `now`."""
        if self.holder is None:
            return
        since = self._granted_at
        if self._free_until is not None:
            since = max(since, min(self._free_until, now))
        self._charge(self.holder, now - since)
        self._granted_at = now

    def _release(self, now: float) -> None:
        """The holder's turn is over (it has answered, or is late): waiting on, it
        is not waking."""
        self._end_shared(now)
        if self.holder is not None:
            acc = self._accounts[self.holder]
            acc.rested = 0.0
            if now - acc.last_active < self.idle_grace:  # busy to the end: a rest starts now
                acc.last_active = now
        self.holder, self._closed_at, self._free_until = None, None, None

    def _exclusive(self, now: float, observed: Mapping[str, Observation]) -> SliceDecision:
        nothing = Observation()
        # A container cut before it answered still has work of its own on the GPU:
        # it waits for nothing until it answers.
        waiting = {n for n in self._accounts
                   if observed.get(n, nothing).waiting and n not in self._late}
        waking = self._waking(waiting)
        if waking:
            self._hand_over(now)
            return self._grant(now, waiting, among=waking)
        holder = self.holder
        if holder is not None and self._closed_at is None:
            # Who would take the GPU if the holder gave it up: under the
            # work-conserving policies anyone waiting (idle time is lent).
            lend = self._config.policy.work_conserving
            others = {n for n in waiting - {holder}
                      if self._eligible(n) or (lend and self._rates[n][0] > 0
                                               and self._accounts[n].cap_credit >= 0)}
            # Idle: it gave up the GPU as soon as someone else waits or drains.
            idle = now - self._accounts[holder].last_active >= self.idle_grace
            preempted = not self._allot[holder].preempts and any(
                self._allot[n].preempts and self._eligible(n) for n in others)
            if others:  # no longer alone: a slice for the company it has now
                self._slice_end = min(self._slice_end, self._granted_at
                                      + self._slice_length(holder))
            ended = now >= self._slice_end
            if ended:  # charge the slice so far: is there credit for another?
                self._charge_holder(now)
            if not (preempted or (others and ended) or (idle and (others or self._late))
                    or (ended and not self._eligible(holder, slack=1e-9))):
                if ended:  # nobody else may take it: a new slice, no drain
                    company = self._active - {holder}
                    alone = LONE_SLICE if self._rates[holder][0] >= 1 else \
                        self.quantum * MAX_QUANTA
                    self._slice_end = now + (self._slice_length(holder) if company else alone)
                wake_at = self._slice_end
                if others or self._late:
                    wake_at = min(wake_at, self._accounts[holder].last_active + self.idle_grace)
                return self._decision(frozenset({holder}), wake_at)
            # Closed now: the answers in `observed` predate this close.
            self._closed_at = now
            return self._decision(frozenset(), now + self._drain_limit(holder))
        if holder is not None and self._closed_at is not None:
            seen = observed.get(holder, nothing)
            acc = self._accounts[holder]
            limit = self._drain_limit(holder)
            if not seen.answered and now < self._closed_at + limit:  # as wake_at is
                return self._decision(frozenset(), self._closed_at + limit)
            # Charged until its answer is seen: what it queued ran past the slice's
            # end, and the time it took to say so kept the GPU from the others. The
            # drain time the answer names is the processes' own claim: one dated
            # early would make the others pay for a late answer.
            self._charge_holder(now)
            if seen.answered:
                acc.drain_limit = min(2 * limit, self.drain_timeout)
            else:  # cut: charged on until it answers, and not granted before
                self._late[holder] = now
                acc.drain_limit = max(limit / 2, self._drain_floor)
                waiting.discard(holder)
            self._release(now)
        return self._grant(now, waiting)

    def _drain_limit(self, name: str) -> float:
        """How long `name`'s drain may take: `drain_timeout`, halved at each cut
        (down to a long slice) and doubled back at each answer in time, so that
        a container that never answers cannot hold the GPU idle a second at a
        time, again and again."""
        return min(self._accounts[name].drain_limit, self.drain_timeout)

    def _settle(self, waiting: Set[str]) -> None:
        """Take out of the books what nobody is owed, before a grant.

        Under the work-conserving policies time used while nobody else wanted
        the GPU is lent, not owed: when every waiting container owes time,
        their common debt goes (keeping their standing relative to their
        shares)."""
        if not self._config.policy.work_conserving:
            return
        owed = [n for n in waiting if self._rates[n][0] > 0]
        standing = [self._accounts[n].credit / self._rates[n][0] for n in owed]
        if standing and max(standing) < 0:
            for name in owed:
                self._accounts[name].credit -= max(standing) * self._rates[name][0]

    def _slice_length(self, name: str) -> float:
        """A quantum for the smallest share among the active containers,
        proportionally more (up to MAX_QUANTA) for larger ones: each switch
        costs the same, so the fewer the better, and the smallest share sets
        how fine it must be."""
        shares = [self._rates[n][0] for n in self._active | {name} if self._rates[n][0] > 0]
        smallest = min(shares, default=self._rates[name][0])
        ratio = self._rates[name][0] / smallest if smallest > 0 else 1.0
        return self.quantum * min(max(ratio, 1.0), MAX_QUANTA)

    def _grant(self, now: float, waiting: Set[str], among: Set[str] | None = None
               ) -> SliceDecision:
        """The GPU to the most owed of `among` (by default: of those waiting)."""
        self._settle(waiting)
        candidates = [n for n in (waiting if among is None else among) if self._eligible(n)]
        if candidates:
            prio = [n for n in candidates if self._allot[n].preempts]
            pool = prio or candidates
            # The most owed for its share: the furthest behind in wall-clock time.
            chosen = max(pool, key=lambda n: (self._accounts[n].credit / self._rates[n][0], n))
            for name in waiting:  # passed over, or granted: none of them is waking now
                self._accounts[name].rested = 0.0
            self.holder = chosen
            self._granted_at, self._slice_end = now, now + self._slice_length(chosen)
            self._accounts[chosen].last_active = now
            wake_at = self._slice_end
            if len(waiting) > 1 or self._late:  # when it may give the GPU up idle
                wake_at = min(wake_at, now + self.idle_grace)
            return self._decision(frozenset({chosen}), wake_at)
        # Nobody may run now: wake when the first waiting one's credits allow.
        wake_at = NEVER
        for name in waiting:
            share, cap = self._rates[name]
            acc = self._accounts[name]
            if share <= 0:
                continue
            slack = self.quantum * ELIGIBLE_SLACK_QUANTA
            need = max((-acc.credit - slack) / share,
                       -acc.cap_credit / cap if cap > 0 else NEVER, 0.0)
            wake_at = min(wake_at, now + need)
        return self._decision(frozenset(), wake_at)

    def _native(self, now: float, dt: float) -> SliceDecision:
        """Policy 5: every gate open, but a capped container's only while its cap
        credit lasts. It is charged the time its gate was open while it was
        active, and after each close until its drain answer: the time it had
        work on the GPU (an upper bound of its GPU time, which the driver's
        own time slicing hides)."""
        self.holder, self._closed_at = None, None
        open_: set[str] = set()
        wake_at = NEVER
        for name, acc in self._accounts.items():
            cap = self._rates[name][1]
            was_open = name in self._native_open
            if was_open and name in self._active:
                acc.used += dt
                if cap < 1:
                    acc.cap_credit -= dt
            if cap >= 1 or (acc.cap_credit >= 0 and name not in self._late):
                open_.add(name)
                if cap < 1:  # when it would run out, charged all along
                    wake_at = min(wake_at, now + max(acc.cap_credit / (1 - cap), self.idle_grace))
                continue
            if was_open:
                self._late[name] = now  # charged on until its drain answer
            if cap > 0:
                wake_at = min(wake_at, now + max(-acc.cap_credit / cap, self.idle_grace))
        self._native_open = frozenset(open_)
        return self._decision(frozenset(open_), wake_at)

    def _decision(self, open_: frozenset[str], wake_at: float) -> SliceDecision:
        wake_at = min((wake_at, *self._overlap.values()))  # when a handover's drain is cut
        return SliceDecision(open=open_, holder=self.holder, wake_at=wake_at,
                             shares=dict(self._shares))

    # -- state kept across a daemon restart or hot update -------------------

    def to_state(self) -> dict[str, Any]:
        """JSON-serialisable accounting state (credits and GPU time used)."""
        return {
            "accounts": {
                n: {"credit": a.credit, "cap_credit": a.cap_credit, "used": a.used}
                for n, a in self._accounts.items()
            },
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back what `to_state` produced; unknown containers are ignored.

        The clock is not restored (a new process may have another clock), so
        the first step after a restore charges nothing."""
        for name, saved in dict(state.get("accounts", {})).items():
            acc = self._accounts.get(name)
            if acc is None:
                continue
            acc.credit = float(saved.get("credit", 0.0))
            acc.cap_credit = float(saved.get("cap_credit", 0.0))
            acc.used = float(saved.get("used", 0.0))
