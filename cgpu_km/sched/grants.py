"""When each container of one GPU may run work: the scheduler's grants as a step
function of time, for the daemon's check of what the driver saw each process do.

A container may run while its gate is open, while it drains after its gate
closed (its drain answer not seen yet), and while it is late (cut, or handed
over from): every span the scheduler charges it for, or knows it runs beside
the holder. An armed gate lets a launch through, which rings: the next step
grants the container or closes the gate, a round trip later; so a container
that never waits at its gate stays armed without ever being granted, and
one may run for SETTLE after a launch went through its armed gate. Such a
launch may have gone through at any time after the step that armed the gate,
and on a starved host the step that sees it may come long after (the
dispatcher wakes late to the ring): a container armed at one step that may
run at the next might have run since the first (`GrantLog.record`; for
SETTLE at most, as long as what went through may run on after), and until
the next step nobody knows whether it did (`GrantHistory.armed`).

The dispatcher records the set at every step that changes it
(`GrantLog.record`), and marks itself alive at every step and heartbeat
(`GrantLog.alive`): a gap longer than `BLIND_AFTER` is a span in which the
gates may have failed open, so nothing is known of it. Under policy 5 every
container may run (`EVERYONE`).

`GrantHistory.quiet` finds the spans in which a container surely could not
run: a process of it that NVML saw running then ran what nobody granted. No
I/O and no clock here: times are seconds of the caller's monotonic clock.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field

__all__ = ["BLIND_AFTER", "EVERYONE", "GrantHistory", "GrantLog"]

EVERYONE = None  # a mark under which every container may run (policy 5, a gate failed open)
# The dispatcher steps or stamps the heartbeat at least every 0.75 s; gates fail
# open when it is 2 s old. A gap of more than this is a span nothing is known of.
BLIND_AFTER = 1.0
# What ran ungated may run on for a while once the gates close: work queued under
# policy 5, or by a container's processes before the dispatcher drove its gate
# (a new region's gates fail open until its first heartbeat). So a container is
# known only from this long after the dispatcher first drove it, and everyone
# only this long after policy 5 ends: the drain limit, which bounds any drain.
SETTLE = 0.5

Mark = tuple[float, frozenset[str] | None]


@dataclass(frozen=True)
class GrantHistory:
    """An immutable copy of a `GrantLog`: `marks` in time order, each set in
    force from its time to the next mark's; `blind` spans are unknown, and so is
    everything before `start`."""

    start: float
    marks: tuple[Mark, ...]
    blind: tuple[tuple[float, float], ...] = ()
    driven: Mapping[str, float] = field(default_factory=dict)  # since when, by name
    # Those whose gates the last step armed, with its time: what they ran since
    # is known only once the next step saw their launches.
    armed: Mapping[str, float] = field(default_factory=dict)
    times: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "times", tuple(t for t, _ in self.marks))

    def allowed(self, name: str, begin: float, end: float) -> float | None:
        """Seconds of [begin, end] in which `name` might run; None when that span
        is not wholly known (before the log began or the container was driven
        for SETTLE, a blind span, a mark under which everyone may run)."""
        if end <= begin:
            return 0.0
        driven = self.driven.get(name)
        if begin < self.start or driven is None or begin < driven + SETTLE:
            return None
        if any(a < end and begin < b for a, b in self.blind):
            return None
        first = max(bisect.bisect_right(self.times, begin) - 1, 0)
        total = 0.0
        for index in range(first, len(self.marks)):
            at, who = self.marks[index]
            if at >= end:
                break
            until = self.marks[index + 1][0] if index + 1 < len(self.marks) else end
            span = min(until, end) - max(at, begin)
            if span <= 0:
                continue
            if who is EVERYONE:
                return None
            if name in who:
                total += span
        return total


    def settled(self, name: str, end: float) -> bool:
        """Whether what `allowed` says of `name` up to `end` is final: not past the
        step that armed its gate (a launch through it since shows only at the
        next step, which counts it from the arming step on)."""
        return end <= self.armed.get(name, math.inf)

    def known_from(self, name: str) -> float | None:
        """From when `allowed` may know `name`: the log's start, or SETTLE after the
        dispatcher first drove it (None: it does not)."""
        driven = self.driven.get(name)
        return None if driven is None else max(self.start, driven + SETTLE)

    def quiet(self, name: str, begin: float, end: float) -> list[tuple[float, float]]:
        """The spans within [begin, end] in which `name` surely could not run
        (known spans only: a blind span or EVERYONE ends a quiet one)."""
        known = self.known_from(name)
        if known is None:
            return []
        begin = max(begin, known)
        end = min(end, self.armed.get(name, math.inf))  # an armed gate: not known yet
        spans: list[tuple[float, float]] = []
        start: float | None = None
        for index in range(max(bisect.bisect_right(self.times, begin) - 1, 0),
                           len(self.marks)):
            at, who = self.marks[index]
            if at >= end:
                break
            until = self.times[index + 1] if index + 1 < len(self.times) else end
            left, right = max(at, begin), min(until, end)
            if right <= left:
                continue
            if who is not EVERYONE and name not in who:
                start = left if start is None else start
            elif start is not None:
                spans.append((start, left))
                start = None
        if start is not None:
            spans.append((start, end))
        for a, b in self.blind:  # what may have failed open is not quiet
            spans = [piece for left, right in spans
                     for piece in ((left, min(right, a)), (max(left, b), right))
                     if piece[1] > piece[0]]
        return spans


class GrantLog:
    """The dispatcher's record of who may run, kept for `horizon` seconds."""

    def __init__(self, start: float, horizon: float = 8.0) -> None:
        self.start = start
        self.horizon = horizon
        self._marks: collections.deque[Mark] = collections.deque([(start, frozenset())])
        self._blind: collections.deque[tuple[float, float]] = collections.deque()
        self._alive_at = start
        self._driven: dict[str, float] = {}
        self._armed: frozenset[str] = frozenset()  # by the last step,
        self._armed_at = start  # at this time
        self._passed: dict[str, float] = {}  # work through an armed gate: runs until

    def record(self, now: float, may_run: Iterable[str] | None,
               driven: Set[str] | None = None, armed: Iterable[str] = (),
               launched: Iterable[str] = ()) -> None:
        """From `now` on, these may run (EVERYONE: all of them); `driven`: the
        containers whose gates the dispatcher drives now (None: as before);
        `armed`: those whose gates it arms now; `launched`: those whose
        processes launched since the last step. One armed at the last step
        that launched may run for SETTLE, granted or not (what went through
        runs whether this step grants it or closes its gate), and one armed
        then that may run now might have run since that step."""
        who = None if may_run is EVERYONE else frozenset(may_run)
        for name in self._armed.intersection(launched):
            self._passed[name] = now + SETTLE
        self._passed = {name: until for name, until in self._passed.items() if until > now}
        if who is not EVERYONE:
            who |= self._passed.keys()
        self.alive(now)
        if driven is not None and driven != self._driven.keys():
            self._driven = {name: self._driven.get(name, now) for name in driven}
        before = self._marks[-1][1]
        if who is not EVERYONE and before is not EVERYONE and self._armed & who - before:
            self._since_armed(self._armed & who - before, max(self._armed_at, now - SETTLE))
        self._armed, self._armed_at = frozenset(armed), now
        if self._marks[-1][1] == who:
            return
        if self._marks[-1][1] is EVERYONE:
            self._blind.append((now, now + SETTLE))
        if self._marks[-1][0] >= now:  # two steps at one instant: the later one counts
            self._marks.pop()
        self._marks.append((now, who))
        self._forget(now)

    def _since_armed(self, names: frozenset[str], since: float) -> None:
        """`names` might have run since `since` (not before the last step),
        through their armed gates."""
        at, who = self._marks[-1]
        assert who is not EVERYONE
        if at >= since:  # the last step changed the set at `since`: it is the mark
            self._marks[-1] = (at, who | names)
        else:
            self._marks.append((since, who | names))

    def alive(self, now: float) -> None:
        """The dispatcher stepped or beat at `now`."""
        if now - self._alive_at > BLIND_AFTER:
            self._blind.append((self._alive_at, now))
        self._alive_at = max(self._alive_at, now)

    def _forget(self, now: float) -> None:
        cutoff = now - self.horizon
        while len(self._marks) > 1 and self._marks[1][0] <= cutoff:
            self._marks.popleft()
        while self._blind and self._blind[0][1] <= cutoff:
            self._blind.popleft()
        self.start = max(self.start, min(cutoff, self._marks[0][0]))

    def history(self, now: float) -> GrantHistory:
        """What is known up to `now` (a dispatcher silent since its last sign of
        life for longer than BLIND_AFTER: blind from then on)."""
        blind = tuple(self._blind)
        if now - self._alive_at > BLIND_AFTER:
            blind += ((self._alive_at, float("inf")),)
        return GrantHistory(start=self.start, marks=tuple(self._marks), blind=blind,
                            driven=dict(self._driven),
                            armed=dict.fromkeys(self._armed, self._armed_at))
