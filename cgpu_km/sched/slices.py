"""Exclusive time slices: who holds a GPU, for how long, from the shares and measured time.

One `SliceScheduler` per GPU. Under policies 0-4 one container's work runs
on the GPU at a time: the scheduler grants a container the GPU (its gate
opens) for a slice of one quantum (a larger share takes more turns, not
longer ones), then ends the slice (its gate closes) and waits until
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
nobody else waits and its credit allows. One that waits for credit only is
company: the holder's slice ends with a drain, and it may be granted again
at once (more turns, as long as the others', not longer ones: each turn
costs its holder a drain's way back, and the smaller share would pay it
more often for the same GPU time). An idle holder (it neither launched
nor waited for the idle grace) gives the GPU up once another container waits;
under policies 0, 2 and 3, where unused time stays idle, at once, alone too:
else it would pay for time nobody used, and containers whose requests leave
the GPU idle between them would fall behind their shares (not a holder whose
share is the whole GPU: nobody else may use it, its idle time is its own).
A drain not answered within the drain limit (`drain_timeout`) is cut: the
GPU is granted, and the late container is charged until its answer is seen
and not granted before. Its queued work runs on beside the next holder:
until it answers or that turn ends, the span is shared and paid half by each,
as after a handover (in full by both, time nobody used would be owed, and
repaid with the GPU idle). Its next drain is waited for as long: it has paid
for its drain, and a container whose processes queue more than a drain limit
(many processes of long kernels) would otherwise be cut at every turn after.

Handovers, for latency: a container that starts waiting after a rest (it
had neither launched, waited nor held the GPU for half a quantum) and is
eligible takes the GPU from its holder at once, instead of after the
holder's slice and drain (so does one in which a process starts to launch
or wait after such a rest of its own: `Observation.process_rest`); so does
one that waits while it is owed OWED_QUANTA quanta more share credit than
the holder of a slice (its processes take turns with their requests, so
the container never rests).
The holder's gate closes and it is late until it answers (not granted
before, charged until then, cut at its drain limit as any holder); the
driver time-slices the two meanwhile, and that shared span is paid half by
each. A busy container waiting on past its own turn never rests, and busy
containers drift about a quantum of credit apart in a slice, so between
them slices and drains are as above; at most MAX_OVERLAP handover drains
run at once.

Armed gates, so that a waking container does not wait for the caller
either: each decision names the containers that would take the GPU at once
if they started waiting now (`SliceDecision.armed`: rested, eligible, of
the holder's priority or higher). Their gates let a launch through and ring
the doorbell; the next step sees the launches as a wait and hands the GPU
over as above. Until that step the container runs uncharged beside the
holder, which pays for the span: at most the caller's latency, once per
rest.

States: the GPU is in one of these (`SliceScheduler.state`, frozen values;
each step goes through the one transition function of the present state)::

                grant                      its slice ends: close
    +------+ ----------> +---------+ -------------------------> +----------+
    | Idle |             | Holding |                            | Draining |
    +------+             +---------+ <------------------------- +----------+
        ^                  |     ^     handover: a container wakes    |
        |                  +-----+     (from Holding too)             |
        |              renewed, or handover                           |
        +-------------------------------------------------------------+
          it answers, or its drain limit cuts it (then it is late);
          the GPU is granted in the same step

    +--------+
    | Native |  policy 5, stepped by `_native`; another policy: Idle
    +--------+

    state     gates open     left when                            for
    Idle      none           someone waiting is eligible          Holding
    Holding   the holder's   its slice ends, still eligible and   Holding (renewed)
                             nobody else waits for the GPU
                             its slice ends with company that     Draining
                             waits (for the GPU, or for credit
                             only), or it is preempted, out of
                             credit, idle
                             a container wakes                    Holding (handover)
    Draining  none           it answers, or its drain limit       Idle, then a grant
                             passes (cut: it is late)             in the same step
                             a container wakes                    Holding (handover)
    Native    per cap        (policy 5; every step stays here;    Idle
                             another policy leaves it)

Beside the state, any number of late containers (`late`), each with its
`Late` record: cut before it answered, or handed over from. A late
container is charged until its answer is seen, and not granted before.
A handover's `Holding` (or the `Draining` after it) names the container
it was handed over by (`sharing`), and a grant after a cut the container
cut: until that one answers or the turn ends, the span is shared and paid
half by each. A handover's drain is cut at its deadline like any drain: it
stays late, and no longer counts against MAX_OVERLAP.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any, TypeAlias

from cgpu_km.sched.allotments import GpuConfig, Policy, allotments

__all__ = [
    "QUANTUM",
    "Draining",
    "Holding",
    "Idle",
    "IdleWatch",
    "Late",
    "Native",
    "Observation",
    "ProcessRests",
    "SliceDecision",
    "SliceScheduler",
    "State",
]


@dataclass(frozen=True)
class Observation:
    """What the data plane shows of one container on one GPU at one instant."""

    waiting: bool = False  # some process waits for the GPU (at the gate, or for its own work)
    launches: int = 0  # launches so far (compared between steps)
    answered: bool = True  # every process that launched answered the latest close
    # The latest of those answers' own drain times: for the log only, never charged
    # on (a process may date its answer as it likes).
    drained_at: float = 0.0
    # When the caller last saw it launch or wait, if it watched (`IdleWatch`);
    # None: at the instant of the observation, if it launched since the last step.
    active_at: float | None = None
    # The longest rest of a process that started to launch or wait since the last
    # observation (`ProcessRests`): a container whose processes take turns with
    # their requests never rests as a whole, but each of those processes does.
    process_rest: float = 0.0


class ProcessRests:
    """The caller's record of each process: how long one that starts to launch
    or wait had rested before, as far as the caller's own looks tell (its
    clock, the process's counters only compared). A process seen for the first
    time has not rested; one that launched between two looks rested at least
    until the earlier one."""

    def __init__(self) -> None:
        # key -> (launches, waiting, when last seen active, when last looked at)
        self._seen: dict[object, tuple[int, bool, float, float]] = {}
        self._looked: dict[object, tuple[int, bool, float, float]] = {}

    def look(self, key: object, launches: int, waiting: bool, now: float) -> float:
        """One process at one look (`key`: any name that is its own); its rest."""
        before = self._seen.get(key)
        rest = 0.0
        active_at = now
        if before is not None:
            was_launches, was_waiting, active_at, looked_at = before
            if launches != was_launches:
                rest, active_at = max(0.0, looked_at - active_at), now
            elif waiting and not was_waiting:
                rest = now - active_at
        if waiting:
            active_at = now
        self._looked[key] = (launches, waiting, active_at, now)
        return rest

    def end_round(self) -> None:
        """After a look at every process: those not looked at are gone."""
        self._seen, self._looked = self._looked, {}


@dataclass(frozen=True)
class IdleWatch:
    """The decision's `wake_at` (`at`) is only to see whether `holder` has gone
    idle (neither launched nor waited for `grace`). A caller that watches the
    holder itself may step at `otherwise` instead, or as soon as the holder
    has been idle for `grace`, and then say when it saw it active last
    (`Observation.active_at`): the same decisions with fewer steps. While the
    holder stays busy the caller may look at it less and less often, up to
    every `patience` (a holder nobody waits for: a quantum; it is then
    charged up to that much idle time once it stops, and a container that
    starts waiting rings, which makes a step and a watch of `grace`)."""

    holder: str
    at: float
    grace: float
    otherwise: float
    patience: float = 0.0  # at most `grace` between looks when not above it


@dataclass(frozen=True)
class SliceDecision:
    """The gates that are open until the next step, and when to step again at the latest."""

    open: frozenset[str]
    holder: str | None
    wake_at: float
    shares: Mapping[str, Fraction] = field(default_factory=dict)
    # Gates that let a launch through until the next step: a launch there is a
    # wait (`SliceScheduler` docstring: armed gates).
    armed: frozenset[str] = frozenset()
    idle_watch: IdleWatch | None = None

    def is_open(self, name: str) -> bool:
        return name in self.open


@dataclass(frozen=True)
class Idle:
    """Nobody holds the GPU (policies 0-4): every gate is closed."""


@dataclass(frozen=True)
class Holding:
    """`holder`'s gate is open for the slice from `slice_start` to `slice_end`."""

    holder: str
    slice_start: float
    slice_end: float
    paid_to: float  # the holder is charged up to here
    # Handed over by this container, whose drain runs beside: until it ends, the
    # time since `paid_to` is shared, paid half by each.
    sharing: str | None = None


@dataclass(frozen=True)
class Draining:
    """`holder`'s gate closed at `closed_at`: its drain answer is awaited, up to its
    drain limit."""

    holder: str
    closed_at: float
    paid_to: float
    sharing: str | None = None


@dataclass(frozen=True)
class Native:
    """Policy 5: the gates in `open` are open."""

    open: frozenset[str] = frozenset()


State: TypeAlias = Idle | Holding | Draining | Native
Turn: TypeAlias = Holding | Draining  # a holder's turn
IDLE = Idle()


@dataclass(frozen=True)
class Late:
    """A container whose turn ended before it answered its close (it was cut, or
    handed over from): charged from `since` until its answer is seen, less
    `refund` (its half of a span it shared); a handover's drain is cut at
    `deadline`."""

    since: float
    deadline: float | None = None
    refund: float = 0.0


@dataclass
class _Account:
    credit: float = 0.0
    cap_credit: float = 0.0
    used: float = 0.0  # GPU seconds charged so far
    last_launches: int | None = None
    last_active: float = -float("inf")
    last_waiting: float = -float("inf")  # the last step that saw it waiting
    # How long it had neither launched nor waited when its present wait began; 0
    # while it waits on past the end of a turn.
    rested: float = 0.0


NEVER = float("inf")
NOTHING = Observation()  # what is seen of a container the observations leave out
# The default quantum: the slice of every share (a larger share takes more
# turns, not longer ones: each turn costs its holder the same, the drain
# answer's way back, so turns of one length cost every share the same
# fraction of its GPU time). The shorter the quantum the more switching costs;
# the longer, the more a short window's share swings (`python -m tests.bench
# --slice 0.01` shows both).
QUANTUM = 0.02
MAX_QUANTA = 4.0  # a lone holder's slice below a whole share, in quanta
ELIGIBLE_SLACK_QUANTA = 0.25  # how far behind in share credit a container may start
REST_QUANTA = 0.5  # how long a container must rest before it may wake into the GPU
# ... or how much further behind in share credit than the holder it must be
# (between busy containers the gap grows by up to a slice in one slice: more
# than that, so that their turns still end as slices do).
OWED_QUANTA = 2.0
# Handovers whose drains may overlap the holder at once (a chain of waking
# containers: each earlier drainer pays in full once its successor's turn ends).
MAX_OVERLAP = 2
# A holder alone with the whole GPU is looked at this often (a container that
# starts waiting rings, and is looked at at once): the dispatcher's only steps
# while nothing happens.
LONE_SLICE = 1.0


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
        self.burst_window = quantum * burst_quanta
        self._config = config
        self._accounts: dict[str, _Account] = {n: _Account() for n in config.containers}
        self._now: float | None = None
        self._now_before = -NEVER  # the step before this one
        self._active: frozenset[str] = frozenset()
        self._state: State = IDLE
        self._late: dict[str, Late] = {}
        self._armed: frozenset[str] = frozenset()
        self._barred: dict[str, float] = {}  # audited: granted nothing until then
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
        self._late = {n: late for n, late in self._late.items() if n in accounts}
        turn = self._state
        if isinstance(turn, Holding | Draining):
            if turn.holder not in accounts:
                self._state = IDLE
            elif turn.sharing is not None and turn.sharing not in accounts:
                assert self._now is not None  # a turn began at a step
                self._end_sharing(self._now)
        self._set_allot()

    def bar(self, name: str, until: float) -> None:
        """An audit: `name` is granted nothing, armed for nothing and takes the GPU
        from nobody until `until`, as if it did not wait; it keeps accruing share
        credit as a waiting container does, and takes its turns back after."""
        if name in self._accounts:
            self._barred[name] = until

    @property
    def barred(self) -> frozenset[str]:
        """Containers under an audit now."""
        return frozenset(self._barred)

    def credits(self) -> dict[str, float]:
        """Share credit per container in seconds (negative: owes GPU time)."""
        return {n: a.credit for n, a in self._accounts.items()}

    def used(self) -> dict[str, float]:
        """GPU seconds charged to each container so far (its measured GPU time)."""
        return {n: a.used for n, a in self._accounts.items()}

    @property
    def state(self) -> State:
        """Who holds the GPU and since when (see the module's docstring)."""
        return self._state

    @property
    def holder(self) -> str | None:
        return self._state.holder if isinstance(self._state, Holding | Draining) else None

    @property
    def draining(self) -> bool:
        return isinstance(self._state, Draining)

    @property
    def late(self) -> frozenset[str]:
        """Containers cut before they answered a close: their answers are awaited."""
        return frozenset(self._late)

    def late_record(self, name: str) -> Late | None:
        """What `name` is charged from while late, or None: it is not."""
        return self._late.get(name)

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
        observed = self._launched_through_armed(observed)
        holder = self.holder
        for name, acc in self._accounts.items():
            seen = observed.get(name, NOTHING)
            if seen.waiting:
                if acc.last_waiting < self._now_before or acc.last_waiting == -NEVER:
                    acc.rested = now - acc.last_active  # a wait begins
                if name != holder:  # a rested process of a waiting container
                    acc.rested = max(acc.rested, seen.process_rest)
                acc.last_waiting = now
            if seen.waiting:
                acc.last_active = now
            elif acc.last_launches is not None and seen.launches != acc.last_launches:
                seen_at = now if seen.active_at is None else min(seen.active_at, now)
                acc.last_active = max(acc.last_active, seen_at)
            acc.last_launches = seen.launches
        self._now_before = now
        self._accrue(dt)
        self._hear_the_late(now, observed)
        # Active: waiting now, or launched or waited within a short while (a busy
        # container's processes are not at the gate every instant: between two
        # turns they drain, wake, launch).
        active = frozenset(n for n, acc in self._accounts.items()
                           if observed.get(n, NOTHING).waiting
                           or now - acc.last_active < self.burst_window)
        if active != self._active:
            self._active = active
            self._set_allot()
        if self._config.policy is Policy.NATIVE:
            return self._native(now, dt)
        return self._exclusive(now, observed)

    def _audited(self, waiting: set[str]) -> set[str]:
        """Those that wait, less the barred, unless that would leave the GPU to
        nobody: an audit is never paid for with idle time (it ends)."""
        state = self._state
        others = waiting - self._barred.keys()
        if (isinstance(state, Holding) and state.holder not in self._barred) or any(
                self._eligible(n) for n in others):
            return others
        self._barred = {}
        return waiting

    def _launched_through_armed(self, observed: Mapping[str, Observation],
                                ) -> Mapping[str, Observation]:
        """`observed`, where a container that launched through its armed gate
        since the last step is waiting (it wants the GPU as one at the gate)."""
        through = {n for n in self._armed & self._accounts.keys()
                   if (seen := observed.get(n)) is not None and not seen.waiting
                   and self._accounts[n].last_launches not in (None, seen.launches)}
        if not through:
            return observed
        return {n: replace(seen, waiting=True) if n in through else seen
                for n, seen in observed.items()}

    def _accrue(self, dt: float) -> None:
        # Every container at every step: locals, and no calls (it is the dispatcher's
        # hot loop).
        holder, active, rates, burst = self.holder, self._active, self._rates, self.burst_window
        for name, acc in self._accounts.items():
            share, cap = rates[name]
            credit = acc.credit + share * dt
            cap_credit = acc.cap_credit + cap * dt
            if name not in active and name != holder:  # idle: no banking beyond a burst
                if credit > share * burst:
                    credit = share * burst
                if cap_credit > cap * burst:
                    cap_credit = cap * burst
            acc.credit, acc.cap_credit = credit, cap_credit

    def _hear_the_late(self, now: float, observed: Mapping[str, Observation]) -> None:
        """A late container that answered is charged up to now (less its half of the
        span it shared) and is late no more; a handover's drain past its deadline
        is cut: it stays late, as a cut drain does (it shares the span until it
        answers or the turn ends, and is no overlap that holds off a waker)."""
        for name in list(self._late):
            late = self._late[name]
            if observed.get(name, NOTHING).answered:
                turn = self._state
                if isinstance(turn, Holding | Draining) and turn.sharing == name:
                    self._end_sharing(now)  # the span it shared ends with its answer
                late = self._late.pop(name)  # with its refund, if sharing just ended
                self._charge(name, now - late.since - late.refund)
            elif late.deadline is not None and now >= late.deadline:
                self._late[name] = replace(late, deadline=None)

    def _eligible(self, name: str, slack: float | None = None) -> bool:
        """May start a slice: its credits are not below zero, give or take a
        little (`slack`, by default a quarter quantum of share credit: a
        container just behind is not left waiting a whole slice for it)."""
        acc = self._accounts[name]
        if slack is None:
            slack = self.quantum * ELIGIBLE_SLACK_QUANTA
        # While a container is audited, the others may run on its time (it takes the
        # time back after, from the share credit it accrued): share credit does not
        # hold them back, caps do.
        lent = bool(self._barred) and name not in self._barred
        return (self._rates[name][0] > 0 and (acc.credit >= -slack or lent)
                and acc.cap_credit >= -1e-9)

    def _waking(self, turn: Turn, now: float, waiting: Set[str]) -> set[str]:
        """Those that may take the GPU from the holder at once: eligible (share
        credit not below a quarter quantum's), waiting after a rest of half a
        quantum (neither launching, waiting nor holding the GPU: a busy
        container whose processes come back to the gate late after its turn,
        on a loaded host, is not waking) or owed (`_owed`), and of the
        holder's priority or higher; none while MAX_OVERLAP handover drains
        run."""
        if self._overlaps_full():
            return set()
        holder = turn.holder
        prio = self._allot[holder].preempts
        return {n for n in waiting
                if n != holder and (self._accounts[n].rested >= self.quantum * REST_QUANTA
                                    or self._owed(n, turn, now))
                and self._eligible(n) and (self._allot[n].preempts or not prio)}

    def _owed(self, name: str, turn: Turn, now: float) -> bool:
        """Whether `name` is further behind its share than the holder of a slice
        under way (a grant now would pick it), by OWED_QUANTA quanta of credit,
        counting what the slice has cost the holder so far: a container whose
        processes overlap their requests never rests, yet its requests should
        not wait out a busy holder's slices. (A drain is waited for as before.)"""
        if not isinstance(turn, Holding):
            return False
        holder = turn.holder
        mine = self._accounts[name].credit
        unpaid = now - turn.paid_to
        theirs = self._accounts[holder].credit - (unpaid / 2 if turn.sharing else unpaid)
        share, holder_share = self._rates[name][0], self._rates[holder][0]
        owed = self.quantum * OWED_QUANTA
        return (mine >= theirs + owed and share > 0
                and (holder_share <= 0 or mine / share > theirs / holder_share))

    # -- the transitions under policies 0-4, one per state -------------------

    def _exclusive(self, now: float, observed: Mapping[str, Observation]) -> SliceDecision:
        # A container cut before it answered still has work of its own on the GPU:
        # it waits for nothing until it answers.
        self._barred = {n: until for n, until in self._barred.items()
                        if until > now and n in self._accounts}
        waiting = {n for n in self._accounts
                   if observed.get(n, NOTHING).waiting and n not in self._late}
        if self._barred:
            waiting = self._audited(waiting)
        state = self._state
        if isinstance(state, Holding | Draining):
            waking = self._waking(state, now, waiting)
            if waking:
                self._hand_over(state, now)
                return self._grant(now, waiting, among=waking, sharing=state.holder)
        if isinstance(state, Holding):
            return self._holding(state, now, waiting)
        if isinstance(state, Draining):
            return self._draining(state, now, observed, waiting)
        self._state = IDLE  # from Native too: a new policy
        return self._grant(now, waiting)

    def _hand_over(self, turn: Turn, now: float) -> None:
        """Handover: the holder's gate closes and the GPU goes to a waking container
        at once: the driver time-slices the two while the holder drains. The holder
        is charged until its answer is seen (it is late until then); the next one
        from then on (the overlap is the cost of what the holder had queued)."""
        closed = turn.closed_at if isinstance(turn, Draining) else now
        self._end_turn(turn, now)
        self._late[turn.holder] = Late(since=now,
                                       deadline=closed + self.drain_timeout)

    def _holding(self, turn: Holding, now: float, waiting: Set[str]) -> SliceDecision:
        """Holding: the slice goes on, is renewed (nobody else may take the GPU) or
        ends (the gate closes: Draining)."""
        holder = turn.holder
        # Who would take the GPU if the holder gave it up: under the
        # work-conserving policies anyone waiting (idle time is lent).
        lend = self._config.policy.work_conserving
        # Company that waits: with a share and cap credit left. While any
        # does, even for share credit only, the holder's turns end as theirs
        # do, with a drain, and it takes more of them (it may be granted again
        # at once), not longer ones: else the smaller share would pay a
        # drain's cost per turn more often than the larger for the same GPU time.
        waiting_company = {n for n in waiting - {holder}
                           if self._rates[n][0] > 0 and self._accounts[n].cap_credit >= 0}
        others = {n for n in waiting - {holder}
                  if self._eligible(n) or (lend and n in waiting_company)}
        takes_turns = bool(others or waiting_company)
        idle = now - self._accounts[holder].last_active >= self.idle_grace
        preempted = not self._allot[holder].preempts and any(
            self._allot[n].preempts and self._eligible(n) for n in others)
        if takes_turns:  # no longer alone: a slice for the company it has now
            turn = replace(turn, slice_end=min(turn.slice_end, turn.slice_start
                                               + self.quantum))
        ended = now >= turn.slice_end
        if ended:  # charge the slice so far: is there credit for another?
            turn = replace(turn, paid_to=self._pay(turn, now))
        gives_up = idle and self._idle_gives_up(holder, bool(others))
        if (preempted or (takes_turns and ended) or gives_up
                or (ended and not self._eligible(holder, slack=1e-9))):
            # Closed now: the answers in `observed` predate this close.
            self._state = Draining(holder, closed_at=now, paid_to=turn.paid_to,
                                   sharing=turn.sharing)
            return self._decision(frozenset(), now + self.drain_timeout)
        if ended:  # nobody else may take it: a new slice, no drain
            company = self._active - {holder}
            alone = LONE_SLICE if self._rates[holder][0] >= 1 else self.quantum * MAX_QUANTA
            turn = replace(turn, slice_start=now,
                           slice_end=now + (self.quantum if company else alone))
        self._state = turn
        idle_at = NEVER
        if self._idle_gives_up(holder, bool(others)):
            idle_at = self._accounts[holder].last_active + self.idle_grace
        return self._decision(frozenset({holder}), turn.slice_end, idle_at,
                              lone=not others and not self._late)

    def _draining(self, turn: Draining, now: float, observed: Mapping[str, Observation],
                  waiting: set[str]) -> SliceDecision:
        """Draining: the holder's answer is awaited until the drain timeout; then
        (cut or not) its turn ends and the GPU is granted in the same step."""
        holder = turn.holder
        seen = observed.get(holder, NOTHING)
        if not seen.answered and now < turn.closed_at + self.drain_timeout:  # as wake_at is
            return self._decision(frozenset(), turn.closed_at + self.drain_timeout)
        # Charged until its answer is seen: what it queued ran past the slice's
        # end, and the time it took to say so kept the GPU from the others. The
        # drain time the answer names is the processes' own claim: one dated
        # early would make the others pay for a late answer.
        self._end_turn(turn, now)
        if seen.answered:
            return self._grant(now, waiting)
        # Cut: charged on until it answers, and not granted before. Its queued
        # work runs on beside the next holder, which the driver time-slices
        # with it: until it answers, or that turn ends, the span is shared and
        # paid half by each, as after a handover (charging both in full would
        # owe time that nobody used, and leave the GPU idle while it is repaid).
        self._late[holder] = Late(since=now)
        waiting.discard(holder)
        return self._grant(now, waiting, sharing=holder)

    def _native(self, now: float, dt: float) -> SliceDecision:
        """Native (policy 5): every gate open, but a capped container's only while its
        cap credit lasts. It is charged the time its gate was open while it was
        active, and after each close until its drain answer: the time it had
        work on the GPU (an upper bound of its GPU time, which the driver's
        own time slicing hides)."""
        state = self._state
        if isinstance(state, Holding | Draining):  # a new policy ends the turn
            self._end_turn(state, now)
        was_open = state.open if isinstance(state, Native) else frozenset()
        open_: set[str] = set()
        wake_at = NEVER
        for name, acc in self._accounts.items():
            cap = self._rates[name][1]
            if name in was_open and name in self._active:
                acc.used += dt
                if cap < 1:
                    acc.cap_credit -= dt
            if cap >= 1 or (acc.cap_credit >= 0 and name not in self._late):
                open_.add(name)
                if cap < 1:  # when it would run out, charged all along
                    wake_at = min(wake_at, now + max(acc.cap_credit / (1 - cap), self.idle_grace))
                continue
            if name in was_open:
                self._late[name] = Late(since=now)  # charged on until its drain answer
            if cap > 0:
                wake_at = min(wake_at, now + max(-acc.cap_credit / cap, self.idle_grace))
        self._state = Native(frozenset(open_))
        return self._decision(frozenset(open_), wake_at)

    # -- what the transitions share -------------------------------------------

    def _pay(self, turn: Turn, now: float) -> float:
        """Charge `turn`'s holder since it last paid (nothing of a span it still
        shares); what it has paid up to now."""
        if turn.sharing is not None:
            return turn.paid_to
        self._charge(turn.holder, now - turn.paid_to)
        return now

    def _end_sharing(self, now: float) -> None:
        """The span in which a handover's holder and the drain it overlaps shared the
        GPU has ended (a handover's drain answered or was cut, or the holder's turn
        ended): each pays half of it, as the driver's time slicing gives each about
        half."""
        turn = self._state
        if not isinstance(turn, Holding | Draining) or turn.sharing is None:
            return
        half = (now - turn.paid_to) / 2
        drainer = self._late.get(turn.sharing)
        if drainer is not None:
            self._late[turn.sharing] = replace(drainer, refund=drainer.refund + half)
        self._charge(turn.holder, half)
        self._state = replace(turn, paid_to=now, sharing=None)

    def _end_turn(self, turn: Turn, now: float) -> None:
        """The holder's turn is over (it has answered, is late, or the GPU is handed
        over): charged up to now, and Idle. Waiting on, it is not waking."""
        self._state = replace(turn, paid_to=self._pay(turn, now))
        self._end_sharing(now)
        acc = self._accounts[turn.holder]
        acc.rested = 0.0
        if now - acc.last_active < self.idle_grace:  # busy to the end: a rest starts now
            acc.last_active = now
        self._state = IDLE

    def _idle_gives_up(self, holder: str, company: bool) -> bool:
        """Whether `holder`, if it goes idle, gives the GPU up (so is watched for
        it): when someone else waits (`company`) or drains; where unused time
        stays idle (policies 0, 2, 3), alone too, or it would pay for time
        nobody used. Not alone with a share of the whole GPU: nobody else may
        use it then, so its idle time is nobody's loss, as where it is lent."""
        if company or self._late:
            return True
        return not (self._config.policy.work_conserving or self._rates[holder][0] >= 1)

    def _overlaps_full(self) -> bool:
        """MAX_OVERLAP handover drains run: nobody more may wake into the GPU."""
        return sum(late.deadline is not None for late in self._late.values()) >= MAX_OVERLAP

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

    def _grant(self, now: float, waiting: Set[str], among: Set[str] | None = None,
               sharing: str | None = None) -> SliceDecision:
        """Idle: the GPU to the most owed of `among` (by default: of those waiting),
        or to nobody yet. After a handover, the new holder shares the GPU with
        the drain of the one it was handed over by (`sharing`)."""
        self._settle(waiting)
        candidates = [n for n in (waiting if among is None else among) if self._eligible(n)]
        if candidates:
            prio = [n for n in candidates if self._allot[n].preempts]
            pool = prio or candidates
            # The most owed for its share: the furthest behind in wall-clock time.
            chosen = max(pool, key=lambda n: (self._accounts[n].credit / self._rates[n][0], n))
            for name in waiting:  # passed over, or granted: none of them is waking now
                self._accounts[name].rested = 0.0
            self._state = Holding(chosen, slice_start=now,
                                  slice_end=now + self.quantum, paid_to=now,
                                  sharing=sharing)
            self._accounts[chosen].last_active = now
            idle_at = NEVER
            if self._idle_gives_up(chosen, len(waiting) > 1):
                idle_at = now + self.idle_grace
            return self._decision(frozenset({chosen}), self._state.slice_end, idle_at,
                                  lone=len(waiting) <= 1 and not self._late)
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

    def _decision(self, open_: frozenset[str], wake_at: float,
                  idle_at: float = NEVER, *, lone: bool = False) -> SliceDecision:
        """The decision to step again at `wake_at` at the latest, and at `idle_at`
        if only to see whether the holder went idle (`IdleWatch`; `lone`: nobody
        else waits for the GPU, so the watch may be patient)."""
        deadlines = (late.deadline for late in self._late.values() if late.deadline is not None)
        wake_at = min((wake_at, *deadlines, *self._barred.values()))  # a cut, an audit's end
        armed, rested_at = self._arm(open_)
        self._armed = armed
        wake_at = min(wake_at, rested_at)
        holder = self.holder
        watch = None
        if idle_at < wake_at and holder is not None:
            watch = IdleWatch(holder, at=idle_at, grace=self.idle_grace, otherwise=wake_at,
                              patience=self.quantum if lone else self.idle_grace)
        return SliceDecision(open=open_, holder=holder, wake_at=min(wake_at, idle_at),
                             shares=dict(self._shares), armed=armed, idle_watch=watch)

    def _arm(self, open_: frozenset[str]) -> tuple[frozenset[str], float]:
        """The containers that would take the GPU at once if they waited now (as
        `_waking` has it: rested, eligible, of the holder's priority or
        higher), and when the next of the others has rested long enough. Never
        the holder: a draining holder whose gate let launches through would not
        drain."""
        if self._config.policy is Policy.NATIVE or self._now is None or self._overlaps_full():
            return frozenset(), NEVER
        holder = self.holder
        prio = holder is not None and self._allot[holder].preempts
        slack = self.quantum * ELIGIBLE_SLACK_QUANTA
        armed: set[str] = set()
        rested_at = NEVER
        for name, acc in self._accounts.items():
            spec = self._config.containers[name]
            if (name in open_ or name == holder or name in self._late
                    or name in self._barred or acc.last_waiting == self._now
                    or spec.weight <= 0
                    or (prio and not spec.highprio)
                    or acc.credit < -slack or acc.cap_credit < -1e-9):
                continue
            ready = acc.last_active + self.quantum * REST_QUANTA
            if ready <= self._now:
                armed.add(name)
            else:
                rested_at = min(rested_at, ready)
        return frozenset(armed), rested_at

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
