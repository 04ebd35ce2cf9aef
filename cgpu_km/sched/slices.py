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
is (that is how shares below 1 hold under policies 0, 2 and 3). A
preempting container that may run and waits ends another's slice at once,
unless that one was granted while it could not run: then the slice is the
other's turn, a quantum as any (cut short whenever the preempting one's
credit came back, the other's turns were slivers that each paid a whole
drain: a capped container beside it lost a fifth of its cap). Positive
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
had neither launched, waited nor held the GPU for half a quantum) and
may run (`may_run`) takes the GPU from its holder at once, instead of after
the holder's slice and drain (so does one in which a process starts to launch
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
if they started waiting now (`SliceDecision.armed`: rested, may run, of
the holder's priority or higher). Their gates let a launch through and ring
the doorbell; the next step sees the launches as a wait and hands the GPU
over as above. Until that step the container runs uncharged beside the
holder, which pays for the span (nobody does where the holder had said it
went idle and unused time stays idle: `vacated`): at most the caller's
latency, once per rest.

States: the GPU is in one of four (`SliceScheduler.state`, frozen values):
`Idle` (every gate closed), `Holding` (the holder's gate open for its
slice), `Draining` (the holder's gate closed, its drain answer awaited),
`Native` (policy 5: the gates of `open`). Beside the state, any number of
late containers (`late`), each with its `Late` record: cut before it
answered, or handed over from. A late container is charged until its
answer is seen, and not granted before. A handover's `Holding` (or the
`Draining` after it) names the container it was handed over by
(`sharing`), and a grant after a cut the container cut: until that one
answers or the turn ends, the span is shared and paid half by each. A
handover's drain is cut at its deadline like any drain: it stays late, and
no longer counts against MAX_OVERLAP.

The rules are one table, `TABLE`: each step works out its `Facts` once
(after it took in the observations, accrued credit and heard the late
answers), then takes the first row for the present state whose guard holds
(`transition`; a move not in the table raises `TransitionError`), and
applies the row's effects (data: `Charge`, `MarkLate`, `Grant`...) in one
place. Nothing else changes the state but `configure` (a holder or drainer
that is gone). `SliceScheduler.moves` counts the moves taken::

    row        from              when                           to
    native     any               policy 5                       Native
    ended      Holding           slice over, with company or    Holding/Idle
                                 others, and it closed itself
    vacated    Holding           a container is waking, the     Holding
                                 holder said it went idle, and
                                 unused time stays idle
    handover   Holding/Draining  a container is waking          Holding
    preempted  Holding           preempted                      Draining
    quit       Holding           idle, said so, and it gives    Holding/Idle
                                 the GPU up
    idle       Holding           idle, and it gives the GPU up  Draining
    turns      Holding           slice over, with company or    Draining
                                 others
    spent      Holding           slice over, and it may not     Draining
                                 renew
    renewed    Holding           slice over                     Holding
    slice      Holding           otherwise                      Holding
    answered   Draining          answered                       Holding/Idle
    cut        Draining          drain expired                  Holding/Idle
    draining   Draining          otherwise                      Draining
    grant      Idle/Native       someone waiting may run        Holding
    nobody     Idle/Native       otherwise                      Idle

The guards, each defined once in `Facts`:

- may run (`may_run`): it has a share, share credit at least
  -ELIGIBLE_SLACK_QUANTA quanta (any, while another is audited), and cap
  credit not below zero; the holder "may renew" by the same rule, paid up to
  now, with no slack (ROUNDING). The grants, the wake time of a GPU left
  idle and the arming ask the same.
- waking: may run, waits after a rest of REST_QUANTA quanta or owed
  OWED_QUANTA quanta more than the holder, of the holder's priority or
  higher, while fewer than MAX_OVERLAP handover drains run.
- company: other waiting containers with a share and cap credit; others:
  those that may run, and under policies 1 and 4 all the company.
- preempted: a preempting container that may run waits, the holder does
  not preempt, and it does not keep its slice (`Holding.keeps_slice`: it
  was granted while such a one waited and could not run).
- idle: the holder neither launched nor waited for the idle grace, and it
  gives the GPU up: someone else waits or drains, or, where unused time
  stays idle (policies 0, 2, 3), unless its share is the whole GPU. Said
  so (`quits`): every process of it said its work had finished and
  launched nothing since (`Observation.idle`): no drain is awaited, and it
  is paid up to when it went idle (half, of a span it shares).
- said idle, before the grace (`vacated`): every process of the holder said
  it went idle (their word stands as soon as their watchers find their
  queues empty; the ring comes a grace later), and unused time stays idle
  (policies 0, 2, 3). A waker then takes a GPU that has been idle since:
  the holder is paid up to its word (a grace before now at most), not until
  a drain answer, and the waker's turn is its own (else the holders of
  requests that come closer together than the idle grace pay for every gap
  between them: the charges add up to the wall time, and their credit walks
  about zero). Under policies 1 and 4 time is lent, not owed: a handover.
- slice over: its end has come (a quantum from its start once it has
  company or others); answered: the holder's drain answer is seen; drain
  expired: `drain_timeout` has passed since the close.

A grant settles first (under policies 1 and 4, a debt that every waiting
container owes is forgiven), then picks the most owed for its share of
those that may run, a preempting one first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass, field, replace
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Generic, NamedTuple, TypeAlias, TypeVar

from cgpu_km.sched.allotments import GpuConfig, Policy, allotments

__all__ = [
    "QUANTUM",
    "TABLE",
    "Draining",
    "Facts",
    "Holding",
    "Idle",
    "IdleWatch",
    "Late",
    "Native",
    "Observation",
    "ProcessRests",
    "Row",
    "SliceDecision",
    "SliceScheduler",
    "State",
    "TransitionError",
    "may_run",
    "transition",
]


@dataclass(frozen=True)
class Observation:
    """What the data plane shows of one container on one GPU at one instant."""

    waiting: bool = False  # some process waits for the GPU (at the gate, or for its own work)
    launches: int = 0  # launches so far (compared between steps)
    # Every process that launched answered the latest close. When its work
    # finished is the process's own claim, so it is not asked: a holder is
    # charged until its answer is seen.
    answered: bool = True
    # When it was last active, if the caller knows (`IdleWatch`: its processes
    # say when they went idle, `idle`); None: at the instant of the observation,
    # if it launched since the last step.
    active_at: float | None = None
    # The longest rest of a process that started to launch or wait since the last
    # observation (`ProcessRests`): a container whose processes take turns with
    # their requests never rests as a whole, but each of those processes does.
    process_rest: float = 0.0
    # Every process of it said it went idle, at `active_at` (libcgpu's idle
    # watch, asked of a watched holder); False: busy, or not asked.
    idle: bool = False
    # Its gate is open, and every process of it stopped at the slice's end it
    # was told (`SliceDecision.close_at`) and answered the close to come: its
    # work there has finished (the process's word, as every answer is).
    closed_itself: bool = False


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
    # The holder's slice ends with a close at `close_at` (another container
    # waits). A caller whose holder's processes stop then by themselves and
    # answer the close ahead (libcgpu's `close_at_ns`) may step on that answer
    # instead: at `close_wake` at the latest (the other deadlines, and the
    # drain limit after `close_at`; `close_at` itself once the holder answered
    # early), where `wake_at` has the slice's end.
    close_at: float | None = None
    close_wake: float = float("inf")

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
    # Granted while a preempting container that waited could not run: its slice
    # is its turn, and no preemption ends it.
    keeps_slice: bool = False


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
# Credit this far below zero is none owed (a float's rounding): the bound of cap
# credit, and of the holder's share credit at the end of its slice.
ROUNDING = 1e-9
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


def may_run(share: float, credit: float, cap_credit: float, slack: float,
            lent: bool = False) -> bool:
    """The one rule of who may run: it has a share, its share credit is not
    below `-slack` (or it is lent: the others' time while one is audited), and
    its cap credit is not below zero."""
    return share > 0 and (credit >= -slack or lent) and cap_credit >= -ROUNDING


# -- the books: credits, and what the steps saw of each container ------------


@dataclass
class _Account:
    credit: float = 0.0
    cap_credit: float = 0.0
    used: float = 0.0  # GPU seconds charged so far


class Ledger:
    """Every container's credits and GPU time: the one place that accrues,
    charges and settles them."""

    def __init__(self, names: Iterable[str]) -> None:
        self.accounts: dict[str, _Account] = {n: _Account() for n in names}
        self._rated: list[tuple[str, _Account, float, float]] = []

    def rate(self, rates: Mapping[str, Rate]) -> None:
        """The rates credit accrues at from now on (after a new allotment, or
        new accounts)."""
        self._rated = [(n, acc, rates[n][0], rates[n][1]) for n, acc in self.accounts.items()]

    def accrue(self, dt: float, active: Set[str], holder: str | None, burst: float) -> None:
        # Every container at every step: locals, and no calls (it is the
        # dispatcher's hot loop).
        for name, acc, share, cap in self._rated:
            credit = acc.credit + share * dt
            cap_credit = acc.cap_credit + cap * dt
            if name not in active and name != holder:  # idle: no banking beyond a burst
                if credit > share * burst:
                    credit = share * burst
                if cap_credit > cap * burst:
                    cap_credit = cap * burst
            acc.credit, acc.cap_credit = credit, cap_credit

    def charge(self, name: str, seconds: float) -> None:
        acc = self.accounts.get(name)
        if acc is not None and seconds > 0:
            acc.credit -= seconds
            acc.cap_credit -= seconds
            acc.used += seconds

    def settle(self, names: Iterable[str], standing: float, rates: Mapping[str, Rate]) -> None:
        """Forgive `names` a common debt of `standing` seconds of wall time each
        (`Facts.grant` works it out): their standing relative to their shares
        stays."""
        for name in names:
            self.accounts[name].credit -= standing * rates[name][0]

    def run_natively(self, names: Iterable[str], dt: float, rates: Mapping[str, Rate]) -> None:
        """Policy 5: `names` had their gates open while active for `dt`."""
        for name in names:
            acc = self.accounts[name]
            acc.used += dt
            if rates[name][1] < 1:
                acc.cap_credit -= dt


@dataclass
class _Seen:
    launches: int | None = None
    last_active: float = -NEVER
    last_waiting: float = -NEVER  # the last step that saw it waiting
    # How long it had neither launched nor waited when its present wait began; 0
    # while it waits on past the end of a turn.
    rested: float = 0.0


class Activity:
    """What the steps saw of each container, in one place: when it last launched
    or waited, how long it had rested when its wait began, which containers
    are active, which gates are armed."""

    def __init__(self, names: Iterable[str]) -> None:
        self.seen: dict[str, _Seen] = {n: _Seen() for n in names}
        self.active: frozenset[str] = frozenset()
        self.waiting: frozenset[str] = frozenset()  # seen waiting at the last step
        self.armed: frozenset[str] = frozenset()
        self._before = -NEVER  # the step before this one

    def keep(self, names: Iterable[str]) -> None:
        """A new configuration: `names` are the containers."""
        self.seen = {n: self.seen.get(n) or _Seen() for n in names}
        self.active = self.active.intersection(self.seen)

    def through_armed(self, observed: Mapping[str, Observation]) -> Mapping[str, Observation]:
        """`observed`, where a container that launched through its armed gate
        since the last step is waiting (it wants the GPU as one at the gate)."""
        through = {n for n in self.armed & self.seen.keys()
                   if (seen := observed.get(n)) is not None and not seen.waiting
                   and self.seen[n].launches not in (None, seen.launches)}
        if not through:
            return observed
        return {n: replace(seen, waiting=True) if n in through else seen
                for n, seen in observed.items()}

    def believed(self, observed: Mapping[str, Observation]) -> Mapping[str, Observation]:
        """`observed`, less the idle reports that a launch belies: one that says
        a container went idle no later than the step before, when it has launched
        since (a process's launch takes its report back; one that keeps it is
        lying, and is taken to be active now)."""
        before = self._before
        belied = {n for n, seen in observed.items()
                  if seen.active_at is not None and seen.active_at <= before
                  and (mine := self.seen.get(n)) is not None
                  and mine.launches not in (None, seen.launches)}
        if not belied:
            return observed
        return {n: replace(seen, idle=False, active_at=None) if n in belied else seen
                for n, seen in observed.items()}

    def observe(self, now: float, observed: Mapping[str, Observation], holder: str | None,
                burst: float) -> frozenset[str]:
        """Take in one step's observations; the containers active now: waiting,
        or launched or waited within `burst` (a busy container's processes are
        not at the gate every instant: between two turns they drain, wake,
        launch)."""
        before = self._before
        active, waiting = [], []
        for name, mine in self.seen.items():
            seen = observed.get(name, NOTHING)
            if seen.waiting:
                waiting.append(name)
                if mine.last_waiting < before or mine.last_waiting == -NEVER:
                    mine.rested = now - mine.last_active  # a wait begins
                if name != holder:  # a rested process of a waiting container
                    mine.rested = max(mine.rested, seen.process_rest)
                mine.last_waiting = now
                mine.last_active = now
                active.append(name)
            else:
                if seen.active_at is not None or (mine.launches is not None
                                                  and seen.launches != mine.launches):
                    seen_at = now if seen.active_at is None else min(seen.active_at, now)
                    mine.last_active = max(mine.last_active, seen_at)
                if now - mine.last_active < burst:
                    active.append(name)
            mine.launches = seen.launches
        self._before = now
        self.waiting = frozenset(waiting)
        return frozenset(active)

    def pass_over(self, names: Iterable[str]) -> None:
        """A grant passed over (or granted) `names`: none of them is waking now."""
        for name in names:
            self.seen[name].rested = 0.0

    def granted(self, name: str, now: float) -> None:
        self.seen[name].last_active = now

    def turn_ended(self, name: str, now: float, grace: float) -> None:
        """Waiting on, it is not waking; busy to the end, a rest starts now."""
        mine = self.seen[name]
        mine.rested = 0.0
        if now - mine.last_active < grace:
            mine.last_active = now


# -- effects: what a move does besides changing the state, as data -------------


@dataclass(frozen=True, slots=True)
class Charge:
    """`name` is charged `seconds` of GPU time."""

    name: str
    seconds: float


@dataclass(frozen=True, slots=True)
class Refund:
    """The late `name` pays `seconds` less when its answer comes (its half of a
    span it shared)."""

    name: str
    seconds: float


@dataclass(frozen=True, slots=True)
class MarkLate:
    """`name` is late: charged from `record.since` until its answer is seen."""

    name: str
    record: Late


@dataclass(frozen=True, slots=True)
class Heard:
    """The late `name` answered: charged up to now (less its refund), late no more."""

    name: str


@dataclass(frozen=True, slots=True)
class Overdue:
    """A handover's drain passed its deadline: cut, it stays late (no overlap)."""

    name: str


@dataclass(frozen=True, slots=True)
class Settle:
    """Under policies 1 and 4: a debt every waiting container owes is forgiven."""

    names: tuple[str, ...]
    standing: float


@dataclass(frozen=True, slots=True)
class Grant:
    """`name` is granted; those in `passed` (it too) are waking no more."""

    name: str
    passed: frozenset[str]


@dataclass(frozen=True, slots=True)
class EndTurn:
    """`name`'s turn is over: waiting on, it is not waking."""

    name: str


@dataclass(frozen=True, slots=True)
class RunNatively:
    """Policy 5: `names` had their gates open while active since the last step."""

    names: frozenset[str]


Effect: TypeAlias = (Charge | Refund | MarkLate | Heard | Overdue | Settle | Grant | EndTurn
                     | RunNatively)
Rate: TypeAlias = tuple[float, float, bool]  # share, cap, preempts (of the present allotment)


# -- the facts a step decides from -------------------------------------------

T = TypeVar("T")


class _once(Generic[T]):
    """A fact worked out at its first use in a step, then kept (as
    functools.cached_property, without its lock: one thread steps)."""

    def __init__(self, compute: Callable[[Any], T]) -> None:
        self.compute = compute
        self.name = compute.__name__

    def __get__(self, facts: Any, owner: Any = None) -> T:
        value = self.compute(facts)
        facts.__dict__[self.name] = value  # found before this descriptor from now on
        return value



class GrantChoice(NamedTuple):
    """Whom a grant picks among `pool`, if anyone; the debt it settles first."""

    chosen: str | None
    settled: tuple[str, ...]
    standing: float  # the common debt forgiven, in seconds of wall time (<= 0)
    keeps_slice: bool
    wake_at: float  # nobody chosen: when the first of `pool` may run


@dataclass(frozen=True, init=False)
class Facts:
    """What one step decides from, computed once at its start (after the books
    took in the observations and the late answers): every guard of the table
    and the grants ask these, and nothing else. (The decision after the move
    arms gates by the same `may_run`, of the books as the move left them.)"""

    now: float
    dt: float
    policy: Policy
    quantum: float
    grace: float
    drain_timeout: float
    rates: Mapping[str, Rate]
    # The present turn as the books stand now: a span it shared with a drain
    # that has just answered is paid (`paid_to` now, `sharing` None).
    turn: Holding | Draining | None
    was_open: frozenset[str]  # Native: the gates open until now
    waiting: frozenset[str]  # waiting for the GPU, not late, not barred
    answered: bool  # the holder answered its close
    closed_itself: bool  # the holder stopped at the end it was told, and answered ahead
    # Every process of the holder said it went idle, what it queued finished, and
    # launched nothing since (`Observation.idle`).
    said_idle: bool
    late: Mapping[str, Late]  # after this step's answers
    barred: frozenset[str]
    # (credit, cap credit) of those that may be asked about: the waiting and the
    # holder (under policy 5: everyone), before this step's move.
    credits: Mapping[str, tuple[float, float]]
    rested: Mapping[str, float]  # of the waiting: how long each rested before its wait
    holder_active: float  # when the holder last launched or waited
    active: frozenset[str]
    # Worked out from the above, as each step needs them:
    holder: str | None  # the turn's
    slack: float  # how far behind in share credit a container may start a turn
    unpaid: float  # what paying the holder up to now charges it (nothing of a span it shares)
    shared_half: float  # the holder's half of the span it shares, if it shares one
    idle: bool  # the holder neither launched nor waited for the idle grace
    overlaps_full: bool  # MAX_OVERLAP handover drains run: nobody more may wake into the GPU
    _grants: dict[tuple[frozenset[str], frozenset[str] | None], GrantChoice] = field(
        compare=False, repr=False)

    def __init__(self, *, now: float, dt: float, policy: Policy, quantum: float, grace: float,
                 drain_timeout: float, rates: Mapping[str, Rate],
                 turn: Holding | Draining | None, was_open: frozenset[str],
                 waiting: frozenset[str], answered: bool, said_idle: bool,
                 closed_itself: bool,
                 late: Mapping[str, Late], barred: frozenset[str],
                 credits: Mapping[str, tuple[float, float]], rested: Mapping[str, float],
                 holder_active: float, active: frozenset[str]) -> None:
        # One write for every field: a frozen dataclass's own __init__ sets each
        # apart, three times as long, and the dispatcher's hot loop makes one a step.
        holder, unpaid, shared_half = None, 0.0, 0.0
        if turn is not None:
            holder = turn.holder
            if turn.sharing is None:
                unpaid = now - turn.paid_to
            else:
                shared_half = (now - turn.paid_to) / 2
        overlaps = sum(late.deadline is not None for late in late.values()) if late else 0
        self.__dict__.update(
            now=now, dt=dt, policy=policy, quantum=quantum, grace=grace,
            drain_timeout=drain_timeout, rates=rates, turn=turn, was_open=was_open,
            waiting=waiting, answered=answered, said_idle=said_idle,
            closed_itself=closed_itself, late=late, barred=barred,
            credits=credits, rested=rested, holder_active=holder_active, active=active,
            holder=holder,
            slack=quantum * ELIGIBLE_SLACK_QUANTA, unpaid=unpaid, shared_half=shared_half,
            idle=now - holder_active >= grace, overlaps_full=overlaps >= MAX_OVERLAP,
            _grants={})

    def may_run(self, name: str) -> bool:
        """May start a turn (`may_run`): by its credits now."""
        credit, cap_credit = self.credits[name]
        return may_run(self.rates[name][0], credit, cap_credit, self.slack,
                       bool(self.barred) and name not in self.barred)

    # The holder's books.

    def credit_after_turn(self, name: str) -> tuple[float, float]:
        """`name`'s credits once the present turn ends now (the holder pays it)."""
        credit, cap_credit = self.credits[name]
        if name == self.holder:
            due = self.unpaid + self.shared_half
            return credit - due, cap_credit - due
        return credit, cap_credit

    # Holding: who else waits, and whether the slice ends.

    @_once
    def company(self) -> frozenset[str]:
        """Others that wait with a share and cap credit left, whether or not their
        share credit allows: while any does, the holder's turns end as theirs
        do, with a drain, and it takes more of them, not longer ones."""
        holder = self.holder
        return frozenset(n for n in self.waiting if n != holder and self.rates[n][0] > 0
                         and self.credits[n][1] >= -ROUNDING)

    @_once
    def others(self) -> frozenset[str]:
        """Others that would take the GPU if the holder gave it up: those that
        may run, and under the work-conserving policies all the company (idle
        time is lent)."""
        holder, lend = self.holder, self.policy.work_conserving
        return frozenset(n for n in self.waiting if n != holder
                         and ((lend and n in self.company) or self.may_run(n)))

    @_once
    def slice_end(self) -> float:
        """The slice's end: a quantum from its start once it has company."""
        turn = self.turn
        assert isinstance(turn, Holding)
        if self.others or self.company:
            return min(turn.slice_end, turn.slice_start + self.quantum)
        return turn.slice_end

    @_once
    def slice_over(self) -> bool:
        return self.now >= self.slice_end

    @_once
    def ended(self) -> bool:
        """Its slice is over with company or others, and it closed itself at its
        end (`Observation.closed_itself`): no drain is awaited."""
        return self.slice_over and self.closed_itself and bool(self.others or self.company)

    def gives_up_when_idle(self, holder: str, company: bool, late: Mapping[str, Late]) -> bool:
        """Whether `holder`, if it goes idle, gives the GPU up (so is watched for
        it): when someone else waits (`company`) or drains; where unused time
        stays idle (policies 0, 2, 3), alone too, or it would pay for time
        nobody used. Not alone with a share of the whole GPU: nobody else may
        use it then, so its idle time is nobody's loss, as where it is lent."""
        if company or late:
            return True
        return not (self.policy.work_conserving or self.rates[holder][0] >= 1)

    @_once
    def gives_up(self) -> bool:
        holder = self.holder
        assert holder is not None
        return self.idle and self.gives_up_when_idle(holder, bool(self.others), self.late)

    @_once
    def vacated(self) -> bool:
        """A container is waking and every process of the holder said it went idle
        (their word stands as soon as their watchers find their queues empty; the
        ring comes a grace later), where unused time stays idle (policies 0, 2,
        3): there a container's credit binds, and holders of requests that come
        closer together than the idle grace would pay for every gap between them
        (the charges add up to the wall time and their credit walks about zero).
        Under the work-conserving policies time is lent, not owed, and a handover
        serves the waker as well."""
        return bool(self.waking) and self.said_idle and not self.policy.work_conserving

    @_once
    def quits(self) -> bool:
        """It gives the GPU up, and its processes said their work had finished:
        no drain to await."""
        return self.said_idle and self.gives_up

    @_once
    def preempted(self) -> bool:
        """A preempting container that may run waits, and the holder does not
        preempt, nor was it granted while such a one could not run (then the
        slice is its turn: a turn is a slice, and one cut short at each of the
        preempting one's turns would pay a drain for a sliver)."""
        turn = self.turn
        assert isinstance(turn, Holding)
        if self.rates[turn.holder][2] or turn.keeps_slice:
            return False
        return any(self.rates[n][2] and self.may_run(n) for n in self.others)

    @_once
    def may_renew(self) -> bool:
        """The holder's credits, paid up to now, allow another slice."""
        holder = self.holder
        assert holder is not None
        credit, cap_credit = self.credits[holder]
        return may_run(self.rates[holder][0], credit - self.unpaid, cap_credit - self.unpaid,
                       ROUNDING, bool(self.barred) and holder not in self.barred)

    def keeps_slice(self, chosen: str, passed: Iterable[str], credit: Callable[[str], bool]
                    ) -> bool:
        """A grant to `chosen` passed over a preempting container that could not
        run (`credit`): the slice is `chosen`'s, unpreempted."""
        return not self.rates[chosen][2] and any(
            self.rates[n][2] and not credit(n) for n in passed if n != chosen)

    # Handovers.

    def owed(self, name: str) -> bool:
        """Whether `name` is further behind its share than the holder of a slice
        under way (a grant now would pick it), by OWED_QUANTA quanta of credit,
        counting what the slice has cost the holder so far: a container whose
        processes overlap their requests never rests, yet its requests should
        not wait out a busy holder's slices. (A drain is waited for as before.)"""
        turn = self.turn
        if not isinstance(turn, Holding):
            return False
        mine = self.credits[name][0]
        theirs = self.credit_after_turn(turn.holder)[0]
        share, holder_share = self.rates[name][0], self.rates[turn.holder][0]
        return (mine >= theirs + self.quantum * OWED_QUANTA and share > 0
                and (holder_share <= 0 or mine / share > theirs / holder_share))

    @_once
    def waking(self) -> frozenset[str]:
        """Those that may take the GPU from the holder at once: that may run,
        waiting after a rest of REST_QUANTA (neither launching, waiting nor
        holding the GPU: a busy container whose processes come back to the gate
        late after its turn, on a loaded host, is not waking) or owed, and of
        the holder's priority or higher; none while MAX_OVERLAP handover
        drains run."""
        turn = self.turn
        if turn is None or self.overlaps_full:
            return frozenset()
        holder = turn.holder
        prio = self.rates[holder][2]
        rest = self.quantum * REST_QUANTA
        return frozenset(n for n in self.waiting
                         if n != holder and (self.rates[n][2] or not prio)
                         and (self.rested[n] >= rest or self.owed(n)) and self.may_run(n))

    # Draining.

    @_once
    def drain_expired(self) -> bool:
        turn = self.turn
        assert isinstance(turn, Draining)
        return self.now >= turn.closed_at + self.drain_timeout

    # Grants.

    def grant(self, pool: frozenset[str], among: frozenset[str] | None = None) -> GrantChoice:
        """The GPU to the most owed of `among` (by default: of `pool`, those
        waiting) that may run, a preempting one first; under the
        work-conserving policies, when every one of `pool` owes time, their
        common debt goes first (time used while nobody else wanted the GPU is
        lent, not owed). The present turn has ended."""
        key = (pool, among)
        memo = self._grants.get(key)
        if memo is not None:
            return memo
        rates, slack, lent = self.rates, self.slack, bool(self.barred)
        books = {n: self.credit_after_turn(n) for n in pool}
        owing = tuple(n for n in pool if rates[n][0] > 0)
        standing = 0.0
        if self.policy.work_conserving and owing:
            standing = min(0.0, max(books[n][0] / rates[n][0] for n in owing))
        settled = books if not standing else {
            n: (books[n][0] - standing * rates[n][0], books[n][1]) for n in pool}

        def runs(n: str) -> bool:
            credit, cap_credit = settled[n]
            return may_run(rates[n][0], credit, cap_credit, slack, lent and n not in self.barred)

        candidates = [n for n in (pool if among is None else among) if runs(n)]
        chosen, wake_at, keeps = None, NEVER, False
        if candidates:
            prio = [n for n in candidates if rates[n][2]]
            # The most owed for its share: the furthest behind in wall-clock time.
            chosen = max(prio or candidates, key=lambda n: (settled[n][0] / rates[n][0], n))
            keeps = self.keeps_slice(chosen, pool, runs)
        else:  # nobody may run now: wake when the first one's credits allow
            for name in owing:
                share, cap, _ = rates[name]
                credit, cap_credit = settled[name]
                need = max((-credit - slack) / share,
                           -cap_credit / cap if cap > 0 else NEVER, 0.0)
                wake_at = min(wake_at, self.now + need)
        choice = GrantChoice(chosen, owing if standing < 0 else (), standing, keeps, wake_at)
        self._grants[key] = choice
        return choice

    # Policy 5.

    @_once
    def native(self) -> tuple[frozenset[str], float, frozenset[str], frozenset[str]]:
        """Policy 5: the gates open now, when to step again, those charged for
        their open gates since the last step, and those that just ran out of cap
        credit (late until their drain answers). Every gate is open, but a
        capped container's only while its cap credit lasts. It is charged the
        time its gate was open while it was active, and after each close until
        its drain answer: the time it had work on the GPU (an upper bound of its
        GPU time, which the driver's own time slicing hides)."""
        open_: set[str] = set()
        charged: set[str] = set()
        late: set[str] = set()
        wake_at = NEVER
        for name, (_, cap, _) in self.rates.items():
            cap_credit = self.credit_after_turn(name)[1]
            if name in self.was_open and name in self.active:
                charged.add(name)
                if cap < 1:
                    cap_credit -= self.dt
            if cap >= 1 or (cap_credit >= -ROUNDING and name not in self.late):
                open_.add(name)
                if cap < 1:  # when it would run out, charged all along
                    wake_at = min(wake_at, self.now + max(cap_credit / (1 - cap), self.grace))
                continue
            if name in self.was_open:
                late.add(name)  # charged on until its drain answer
            if cap > 0:
                wake_at = min(wake_at, self.now + max(-cap_credit / cap, self.grace))
        return frozenset(open_), wake_at, frozenset(charged), frozenset(late)


# -- the table ------------------------------------------------------------------


class TransitionError(RuntimeError):
    """A move that is not in the table."""


Move: TypeAlias = tuple[State, tuple[Effect, ...]]


@dataclass(frozen=True, eq=False)
class Row:
    """One rule: from a state of a kind in `source`, when `guard` holds (the
    first such row of the table), the GPU moves to a state of a kind in
    `targets`; `move` builds it and the effects. `when` and `does` say the
    guard and the effects in words (docs/developer/scheduler.md shows them)."""

    name: str
    source: tuple[type, ...]
    guard: Callable[[State, Facts], bool]
    targets: tuple[type, ...]
    move: Callable[[State, Facts], Move]
    when: str
    does: str


def _end_turn(f: Facts, until: float | None = None) -> list[Effect]:
    """The holder's turn is over (it has answered, is late, or the GPU is handed
    over): charged up to now (or `until`), half of a span it shared included
    (the other half is the drainer's refund)."""
    turn = f.turn
    assert turn is not None
    span = (f.now if until is None else until) - turn.paid_to
    paid = span / 2 if turn.sharing is not None else span
    effects: list[Effect] = [Charge(turn.holder, paid)]
    if turn.sharing is not None and turn.sharing in f.late:
        effects.append(Refund(turn.sharing, paid))
    effects.append(EndTurn(turn.holder))
    return effects


def _granted(f: Facts, effects: list[Effect], pool: frozenset[str],
             among: frozenset[str] | None = None, sharing: str | None = None) -> Move:
    """Idle (the turn, if any, has ended): a grant among `pool`, or nobody yet."""
    choice = f.grant(pool, among)
    if choice.settled:
        effects.append(Settle(choice.settled, choice.standing))
    if choice.chosen is None:
        return IDLE, tuple(effects)
    effects.append(Grant(choice.chosen, pool))
    return Holding(choice.chosen, slice_start=f.now, slice_end=f.now + f.quantum,
                   paid_to=f.now, sharing=sharing, keeps_slice=choice.keeps_slice), tuple(effects)


def _native(state: State, f: Facts) -> Move:
    effects = _end_turn(f) if f.turn is not None else []
    open_, _, charged, late = f.native
    effects.append(RunNatively(charged))
    effects.extend(MarkLate(n, Late(since=f.now)) for n in sorted(late))
    return Native(open_), tuple(effects)


def _hand_over(state: State, f: Facts) -> Move:
    turn = f.turn
    assert turn is not None
    closed = turn.closed_at if isinstance(turn, Draining) else f.now
    effects = _end_turn(f)
    effects.append(MarkLate(turn.holder, Late(since=f.now, deadline=closed + f.drain_timeout)))
    return _granted(f, effects, f.waiting, among=f.waking, sharing=turn.holder)


def _hand_over_vacated(state: State, f: Facts) -> Move:
    """The holder said it went idle: no drain is awaited, the waker's turn is
    its own, and the holder is paid up to its word (the GPU was idle until the
    waker came), but for no more than the idle grace before now: a holder
    idle longer would have quit, and a process that says it went idle while it
    runs on gains no more than under `quit`."""
    turn = f.turn
    assert isinstance(turn, Holding)
    until = min(max(f.holder_active, turn.paid_to, f.now - f.grace), f.now)
    return _granted(f, _end_turn(f, until), f.waiting, among=f.waking)


def _close(state: State, f: Facts) -> Move:
    """Close. After the slice's end the drain began then: a holder told that
    end (`SliceDecision.close_at`) stopped by itself, and its drain limit runs
    from there, however late the step that sees its answer."""
    turn = f.turn
    assert isinstance(turn, Holding)
    if f.slice_over:
        closed = min(f.now, f.slice_end)
        if f.unpaid:  # the slice so far is paid at its end
            return (Draining(turn.holder, closed_at=closed, paid_to=f.now, sharing=turn.sharing),
                    (Charge(turn.holder, f.unpaid),))
        return Draining(turn.holder, closed_at=closed, paid_to=turn.paid_to,
                        sharing=turn.sharing), ()
    return Draining(turn.holder, closed_at=f.now, paid_to=turn.paid_to, sharing=turn.sharing), ()


def _renew(state: State, f: Facts) -> Move:
    turn = f.turn
    assert isinstance(turn, Holding)
    holder = turn.holder
    company = f.active - {holder}
    alone = LONE_SLICE if f.rates[holder][0] >= 1 else f.quantum * MAX_QUANTA
    renewed = Holding(holder, slice_start=f.now,
                      slice_end=f.now + (f.quantum if company else alone),
                      paid_to=turn.paid_to if turn.sharing is not None else f.now,
                      sharing=turn.sharing,
                      keeps_slice=f.keeps_slice(holder, f.waiting, f.may_run))
    return renewed, (Charge(holder, f.unpaid),) if f.unpaid else ()


def _go_on(state: State, f: Facts) -> Move:
    turn = f.turn
    assert isinstance(turn, Holding)
    if f.slice_end == turn.slice_end:
        return turn, ()
    return replace(turn, slice_end=f.slice_end), ()


def _answered(state: State, f: Facts) -> Move:
    return _granted(f, _end_turn(f), f.waiting)


def _cut(state: State, f: Facts) -> Move:
    turn = f.turn
    assert turn is not None
    effects = _end_turn(f)
    effects.append(MarkLate(turn.holder, Late(since=f.now)))
    return _granted(f, effects, f.waiting - {turn.holder}, sharing=turn.holder)


def _quit(state: State, f: Facts) -> Move:
    """Its processes said their work had finished and launched nothing since: no
    drain is awaited, and it is paid up to the later of their word and what
    the steps saw of it (the grace and the report's way back are nobody's)."""
    turn = f.turn
    assert isinstance(turn, Holding)
    until = min(max(f.holder_active, turn.paid_to), f.now)
    return _granted(f, _end_turn(f, until), f.waiting - {turn.holder})


def _drain_on(state: State, f: Facts) -> Move:
    assert f.turn is not None
    return f.turn, ()


def _grant_idle(state: State, f: Facts) -> Move:
    return _granted(f, [], f.waiting)


def _is_native(s: State, f: Facts) -> bool:
    return f.policy is Policy.NATIVE


def _always(s: State, f: Facts) -> bool:
    return True


# The rules, in order: a step takes the first row for the present state's kind
# whose guard holds. The module docstring and docs/developer/scheduler.md show
# the same table (tests/sched/test_table.py holds them to it).
TABLE: tuple[Row, ...] = (
    Row("native", (Idle, Holding, Draining, Native), _is_native, (Native,), _native,
        "policy 5",
        "end the turn; charge the open gates; a capped one out of cap credit closes, late"),
    Row("ended", (Holding,), lambda s, f: f.ended, (Holding, Idle), _answered,
        "slice over, with company or others, and it closed itself", "end the turn; grant"),
    Row("vacated", (Holding,), lambda s, f: f.vacated, (Holding,), _hand_over_vacated,
        "a container is waking, the holder said it went idle, and unused time stays idle",
        "end the turn, paid to its last activity (a grace ago at most); grant a waker"),
    Row("handover", (Holding, Draining), lambda s, f: bool(f.waking), (Holding,), _hand_over,
        "a container is waking",
        "end the turn; the holder late (to its drain limit); grant a waker, shared"),
    Row("preempted", (Holding,), lambda s, f: f.preempted, (Draining,), _close,
        "preempted", "close (pay the slice if it is over)"),
    Row("quit", (Holding,), lambda s, f: f.quits, (Holding, Idle), _quit,
        "idle, said so, and it gives the GPU up",
        "end the turn, paid to its last activity; grant"),
    Row("idle", (Holding,), lambda s, f: f.gives_up, (Draining,), _close,
        "idle, and it gives the GPU up", "close (pay the slice if it is over)"),
    Row("turns", (Holding,), lambda s, f: f.slice_over and bool(f.others or f.company),
        (Draining,), _close, "slice over, with company or others", "close; pay the slice"),
    Row("spent", (Holding,), lambda s, f: f.slice_over and not f.may_renew, (Draining,),
        _close, "slice over, and it may not renew", "close; pay the slice"),
    Row("renewed", (Holding,), lambda s, f: f.slice_over, (Holding,), _renew,
        "slice over", "pay the slice; a new slice, no drain"),
    Row("slice", (Holding,), _always, (Holding,), _go_on,
        "otherwise", "none (a quantum's slice once it has company or others)"),
    Row("answered", (Draining,), lambda s, f: f.answered, (Holding, Idle), _answered,
        "answered", "end the turn; grant"),
    Row("cut", (Draining,), lambda s, f: f.drain_expired, (Holding, Idle), _cut,
        "drain expired", "end the turn; the holder late; grant, shared with it"),
    Row("draining", (Draining,), _always, (Draining,), _drain_on, "otherwise", "none"),
    Row("grant", (Idle, Native), lambda s, f: f.grant(f.waiting).chosen is not None,
        (Holding,), _grant_idle, "someone waiting may run", "grant"),
    Row("nobody", (Idle, Native), _always, (Idle,), _grant_idle,
        "otherwise", "settle; wake when the first one may run"),
)
_ROWS: dict[type, tuple[Row, ...]] = {
    kind: tuple(row for row in TABLE if kind in row.source)
    for kind in (Idle, Holding, Draining, Native)
}


def transition(state: State, facts: Facts) -> tuple[State, tuple[Effect, ...], Row]:
    """The first row of the table for `state` whose guard holds: the state it
    moves to, its effects, and the row. A move the table does not have raises
    TransitionError."""
    rows = _ROWS.get(type(state))
    if rows is None:
        raise TransitionError(f"no row of the table leaves {state!r}")
    for row in rows:
        if row.guard(state, facts):
            new, effects = row.move(state, facts)
            if type(new) not in row.targets:
                raise TransitionError(f"{row.name}: {type(state).__name__} to "
                                      f"{type(new).__name__} is not in the table")
            return new, effects, row
    raise TransitionError(f"no row of the table leaves {state!r} with these facts")


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
        self._ledger = Ledger(config.containers)
        self._activity = Activity(config.containers)
        self._now: float | None = None
        self._state: State = IDLE
        self._late: dict[str, Late] = {}
        self._barred: dict[str, float] = {}  # audited: granted nothing until then
        self._moves: dict[tuple[type, Row, type], int] = {}
        self._waiting_config: GpuConfig | None = None
        self._waiting_rates: dict[str, Rate] = {}
        self._armable: list[tuple[str, _Seen, _Account, float, bool]] = []
        self._set_allot()

    @property
    def config(self) -> GpuConfig:
        return self._config

    def configure(self, config: GpuConfig) -> None:
        """Apply a new configuration; it takes effect at the next step.

        Containers keep their accounts unless the policy changed (then every
        credit starts afresh so that the new policy holds at once). A turn
        whose holder is gone ends (Idle), and a span shared with a drainer
        that is gone is paid: the only changes of state outside a step."""
        fresh = config.policy != self._config.policy
        accounts: dict[str, _Account] = {}
        for name in config.containers:
            old = self._ledger.accounts.get(name)
            if old is None:
                accounts[name] = _Account()
            elif fresh:
                accounts[name] = _Account(used=old.used)
            else:
                accounts[name] = old
        self._ledger.accounts = accounts
        self._activity.keep(config.containers)
        self._config = config
        self._late = {n: late for n, late in self._late.items() if n in accounts}
        turn = self._state
        if isinstance(turn, Holding | Draining):
            if turn.holder not in accounts:
                self._state = IDLE
            elif turn.sharing is not None and turn.sharing not in accounts:
                assert self._now is not None  # a turn began at a step
                self._ledger.charge(turn.holder, (self._now - turn.paid_to) / 2)
                self._state = replace(turn, paid_to=self._now, sharing=None)
        self._set_allot()

    def bar(self, name: str, until: float) -> None:
        """An audit: `name` is granted nothing, armed for nothing and takes the GPU
        from nobody until `until`, as if it did not wait; it keeps accruing share
        credit as a waiting container does, and takes its turns back after."""
        if name in self._ledger.accounts:
            self._barred[name] = until

    @property
    def barred(self) -> frozenset[str]:
        """Containers under an audit now."""
        return frozenset(self._barred)

    def credits(self) -> dict[str, float]:
        """Share credit per container in seconds (negative: owes GPU time)."""
        return {n: a.credit for n, a in self._ledger.accounts.items()}

    def used(self) -> dict[str, float]:
        """GPU seconds charged to each container so far (its measured GPU time)."""
        return {n: a.used for n, a in self._ledger.accounts.items()}

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

    @property
    def moves(self) -> Mapping[tuple[str, str, str], int]:
        """The moves the steps took so far: (state kind, row of `TABLE`, state kind)
        to how many times."""
        return {(source.__name__, row.name, target.__name__): count
                for (source, row, target), count in self._moves.items()}

    def moves_by_row(self) -> dict[str, int]:
        """The moves the steps took so far, by row of `TABLE`."""
        counts: dict[str, int] = {}
        for (_source, row, _target), count in self._moves.items():
            counts[row.name] = counts.get(row.name, 0) + count
        return counts

    def _set_allot(self) -> None:
        active = self._activity.active
        self._allot = allotments(self._config, active)
        # Handed out with every decision, never changed (a new allotment is a new map).
        self._shares: Mapping[str, Fraction] = MappingProxyType(
            {n: a.share for n, a in self._allot.items()})
        self._rates: dict[str, Rate] = {
            n: (float(a.share), float(a.cap), a.preempts) for n, a in self._allot.items()
        }
        # What each container would have once it waits (it is active then): the
        # arming's share and priority. Everyone active: only the sign of a share
        # and `preempts` are asked, and those do not depend on who else is.
        if self._waiting_config is not self._config:
            self._waiting_config = self._config
            self._waiting_rates = {
                n: (float(a.share), float(a.cap), a.preempts)
                for n, a in allotments(self._config, self._config.containers.keys()).items()
            }
        self._ledger.rate(self._rates)
        accounts, seen = self._ledger.accounts, self._activity.seen
        self._armable = [(n, seen[n], accounts[n], share, preempts)
                         for n, (share, _, preempts) in self._waiting_rates.items()
                         if share > 0]  # without a share, none may run

    def step(self, now: float, observed: Mapping[str, Observation]) -> SliceDecision:
        """Account the time since the last step and decide who holds the GPU now:
        take in the observations (`Activity`), accrue credit (`Ledger`), hear the
        late, work out the `Facts`, move by the table (`transition`), apply the
        move's effects, and decide."""
        dt = 0.0 if self._now is None else now - self._now
        if dt < 0:
            raise ValueError(f"time went backwards: {now} < {self._now}")
        self._now = now
        activity = self._activity
        observed = activity.believed(activity.through_armed(observed))
        holder = self.holder
        active = activity.observe(now, observed, holder, self.burst_window)
        self._ledger.accrue(dt, activity.active, holder, self.burst_window)
        turn = self._hear_the_late(now, observed)
        if active != activity.active:
            activity.active = active
            self._set_allot()
        facts = self._facts(now, dt, observed, turn)
        state = self._state
        new, effects, row = transition(state, facts)
        self._apply(effects, facts)
        self._state = new
        key = (type(state), row, type(new))
        self._moves[key] = self._moves.get(key, 0) + 1
        return self._decide(row, new, facts)

    def _hear_the_late(self, now: float, observed: Mapping[str, Observation],
                       ) -> Holding | Draining | None:
        """A late container that answered is charged up to now (less its half of the
        span it shared) and is late no more; a handover's drain past its deadline
        is cut: it stays late, as a cut drain does (it shares the span until it
        answers or the turn ends, and is no overlap that holds off a waker). The
        present turn as the books stand after."""
        state = self._state
        turn = state if isinstance(state, Holding | Draining) else None
        if not self._late:
            return turn
        effects: list[Effect] = []
        for name, late in self._late.items():
            if observed.get(name, NOTHING).answered:
                if turn is not None and turn.sharing == name:  # its answer ends the span
                    half = (now - turn.paid_to) / 2
                    effects += (Charge(turn.holder, half), Refund(name, half))
                    turn = replace(turn, paid_to=now, sharing=None)
                effects.append(Heard(name))
            elif late.deadline is not None and now >= late.deadline:
                effects.append(Overdue(name))
        self._apply(effects, None)
        return turn

    def _facts(self, now: float, dt: float, observed: Mapping[str, Observation],
               turn: Holding | Draining | None) -> Facts:
        accounts = self._ledger.accounts
        state = self._state
        holder = None if turn is None else turn.holder
        native = self._config.policy is Policy.NATIVE
        waiting: frozenset[str] = frozenset()
        if not native:
            # A container cut before it answered still has work of its own on the
            # GPU: it waits for nothing until it answers.
            if self._barred:
                self._barred = {n: until for n, until in self._barred.items()
                                if until > now and n in accounts}
            waiting = self._activity.waiting
            if self._late:
                waiting = waiting.difference(self._late)
            if self._barred:
                waiting = self._audited(waiting, turn)
        names = accounts.keys() if native else waiting | {holder} if holder else waiting
        seen = self._activity.seen
        return Facts(
            now=now, dt=dt, policy=self._config.policy, quantum=self.quantum,
            grace=self.idle_grace, drain_timeout=self.drain_timeout, rates=self._rates,
            turn=turn, was_open=state.open if isinstance(state, Native) else frozenset(),
            waiting=waiting,
            answered=holder is not None and observed.get(holder, NOTHING).answered,
            said_idle=holder is not None and observed.get(holder, NOTHING).idle,
            closed_itself=holder is not None and observed.get(holder, NOTHING).closed_itself,
            late=dict(self._late), barred=frozenset(self._barred),
            credits={n: (accounts[n].credit, accounts[n].cap_credit) for n in names},
            rested={n: seen[n].rested for n in waiting},
            holder_active=seen[holder].last_active if holder else -NEVER,
            active=self._activity.active,
        )

    def _audited(self, waiting: frozenset[str], turn: Holding | Draining | None,
                 ) -> frozenset[str]:
        """Those that wait, less the barred, unless that would leave the GPU to
        nobody: an audit is never paid for with idle time (it ends). (The
        others are lent the barred one's time: `may_run` asks their cap only.)"""
        others = waiting.difference(self._barred)
        accounts, slack = self._ledger.accounts, self.quantum * ELIGIBLE_SLACK_QUANTA
        if (isinstance(turn, Holding) and turn.holder not in self._barred) or any(
                may_run(self._rates[n][0], accounts[n].credit, accounts[n].cap_credit, slack,
                        lent=True) for n in others):
            return others
        self._barred = {}
        return waiting

    def _apply(self, effects: Iterable[Effect], facts: Facts | None) -> None:
        """The one place where a move's effects change the books."""
        ledger, activity, late, now = self._ledger, self._activity, self._late, self._now
        assert now is not None
        for effect in effects:
            if isinstance(effect, Charge):
                ledger.charge(effect.name, effect.seconds)
            elif isinstance(effect, Grant):
                activity.pass_over(effect.passed)
                activity.granted(effect.name, now)
            elif isinstance(effect, EndTurn):
                activity.turn_ended(effect.name, now, self.idle_grace)
            elif isinstance(effect, MarkLate):
                late[effect.name] = effect.record
            elif isinstance(effect, Settle):
                ledger.settle(effect.names, effect.standing, self._rates)
            elif isinstance(effect, Refund):
                record = late.get(effect.name)
                if record is not None:
                    late[effect.name] = replace(record, refund=record.refund + effect.seconds)
            elif isinstance(effect, Heard):
                record = late.pop(effect.name)
                ledger.charge(effect.name, now - record.since - record.refund)
            elif isinstance(effect, Overdue):
                late[effect.name] = replace(late[effect.name], deadline=None)
            elif isinstance(effect, RunNatively):
                assert facts is not None
                ledger.run_natively(effect.names, facts.dt, self._rates)
            else:  # pragma: no cover - every effect is one of the above
                raise TransitionError(f"an effect the table does not know: {effect!r}")

    # -- the decision after the move -------------------------------------------

    def _decide(self, row: Row, state: State, f: Facts) -> SliceDecision:
        """The gates open until the next step, and when that step comes at the latest."""
        now = f.now
        if isinstance(state, Native):
            return self._decision(state.open, f.native[1], f)
        if isinstance(state, Draining):
            return self._decision(frozenset(), state.closed_at + self.drain_timeout, f)
        if isinstance(state, Holding) and row.name in ("slice", "renewed"):
            holder = state.holder
            idle_at = NEVER
            company = bool(f.others or f.company)
            if f.gives_up_when_idle(holder, bool(f.others), self._late):
                idle_at = f.holder_active + self.idle_grace
            return self._decision(frozenset({holder}), state.slice_end, f, idle_at,
                                  lone=not f.others and not self._late, closes=company,
                                  answered=f.closed_itself)
        pool = f.waiting - {f.holder} if row.name == "cut" and f.holder else f.waiting
        if isinstance(state, Holding):  # a grant
            company = len(pool) > 1
            idle_at = now + self.idle_grace if f.gives_up_when_idle(
                state.holder, company, self._late) else NEVER
            return self._decision(frozenset({state.holder}), state.slice_end, f, idle_at,
                                  lone=not company and not self._late, closes=company)
        return self._decision(frozenset(), f.grant(pool).wake_at, f)

    def _decision(self, open_: frozenset[str], wake_at: float, f: Facts,
                  idle_at: float = NEVER, *, lone: bool = False,
                  closes: bool = False, answered: bool = False) -> SliceDecision:
        """The decision to step again at `wake_at` at the latest, and at `idle_at`
        if only to see whether the holder went idle (`IdleWatch`; `lone`: nobody
        else waits for the GPU, so the watch may be patient). `closes`: `wake_at`
        is the end of a slice that another container waits for
        (`SliceDecision.close_at`); `answered`: its holder already answered that
        end (early: libcgpu answers at the end, a hostile process at once), so
        no ring is to come and the step is at the end itself."""
        close_at = wake_at if closes else None
        others_at = NEVER  # every deadline but the slice's end
        if self._late or self._barred:  # a cut, an audit's end
            deadlines = (late.deadline for late in self._late.values()
                         if late.deadline is not None)
            others_at = min((others_at, *deadlines, *self._barred.values()))
        armed, rested_at = self._arm(open_, f)
        self._activity.armed = armed
        others_at = min(others_at, rested_at)
        wake_at = min(wake_at, others_at)
        close_wake = NEVER
        if close_at is not None:
            close_wake = min(close_at + (0 if answered else self.drain_timeout), others_at)
        holder = self.holder
        watch = None
        if idle_at < wake_at and holder is not None:
            watch = IdleWatch(holder, at=idle_at, grace=self.idle_grace, otherwise=wake_at,
                              patience=self.quantum if lone else self.idle_grace)
        return SliceDecision(open=open_, holder=holder, wake_at=min(wake_at, idle_at),
                             shares=self._shares, armed=armed, idle_watch=watch,
                             close_at=close_at, close_wake=close_wake)

    def _arm(self, open_: frozenset[str], f: Facts) -> tuple[frozenset[str], float]:
        """The containers that would take the GPU at once if they waited now (as
        `Facts.waking` has it: rested, may run, of the holder's priority or
        higher; by their credits after this step's move, and by the share and
        priority they have once they wait), and when the next of the others has
        rested long enough. Never the holder: a draining holder whose gate let
        launches through would not drain."""
        if f.policy is Policy.NATIVE or sum(
                late.deadline is not None for late in self._late.values()) >= MAX_OVERLAP:
            return frozenset(), NEVER
        holder = self.holder
        prio = holder is not None and self._rates[holder][2]
        now, slack, rest = f.now, f.slack, self.quantum * REST_QUANTA
        skip = open_ | self._late.keys() | self._barred.keys()
        if holder is not None:
            skip |= {holder}
        armed: set[str] = set()
        rested_at = NEVER
        for name, mine, acc, share, preempts in self._armable:
            if (mine.last_waiting == now or name in skip or (prio and not preempts)
                    or not may_run(share, acc.credit, acc.cap_credit, slack)):
                continue
            ready = mine.last_active + rest
            if ready <= now:
                armed.add(name)
            elif ready < rested_at:
                rested_at = ready
        return frozenset(armed), rested_at

    # -- state kept across a daemon restart or hot update -------------------

    def to_state(self) -> dict[str, Any]:
        """JSON-serialisable accounting state (credits and GPU time used)."""
        return {
            "accounts": {
                n: {"credit": a.credit, "cap_credit": a.cap_credit, "used": a.used}
                for n, a in self._ledger.accounts.items()
            },
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back what `to_state` produced; unknown containers are ignored.

        The clock is not restored (a new process may have another clock), so
        the first step after a restore charges nothing."""
        for name, saved in dict(state.get("accounts", {})).items():
            acc = self._ledger.accounts.get(name)
            if acc is None:
                continue
            acc.credit = float(saved.get("credit", 0.0))
            acc.cap_credit = float(saved.get("cap_credit", 0.0))
            acc.used = float(saved.get("used", 0.0))
