"""A GPU and its containers in simulated time, driving a `SliceScheduler`.

The model is the one the product is built for: processes that launch
kernels while their container's gate is open or armed (at most `depth` queued each),
a GPU that time-slices between processes with queued work (as a real GPU
does between contexts, `timeslice` each), and drain answers that come when a
process's queue has emptied after a close (what libcgpu's watcher reports),
`answer_delay` later. The scheduler is stepped when a process starts waiting
or answers (the doorbell), when its first launch through an armed gate
rings (as libcgpu's does, once per arming), and at the time its decision
names, each `step_delay` late. A holder that the decision watches for going
idle (`IdleWatch`) hears from its processes as from libcgpu's watcher: each
says since when it has been idle, `answer_delay` after it has launched
nothing for the grace and its queue is empty, and rings once that is a
grace past; a launch takes that back. As libcgpu reports it, a process waits while
a launch is held at the gate or, busy, at its in-flight bound; a request's
synchronize is no wait. Shares are counted in completed kernels per container:
the model's own count, never the scheduler's figures.

A process with `every` > 0 serves requests instead of launching back to
back: at `next_request`, then every `every` after it (a late request skips
the times it missed), it wants to launch `depth` kernels, and the request
ends when the last of them completes; `requests` records, for each
one, when it began and ended and how many kernels every process had
completed at those two times (`completed_at`), so that a test can count
what ran before it without a clock. A process's kernels may vary in length
(`spread`: drawn by a generator of its own, seeded, so every run is the same).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cgpu_km.sched import Observation, ProcessRests, SliceScheduler


@dataclass
class Proc:
    """One process of a container: `kernel` seconds per kernel, `depth` queued at most."""

    container: str
    kernel: float
    depth: int = 2
    queue: list[float] = field(default_factory=list)  # remaining seconds of each queued kernel
    launches: int = 0
    completed: int = 0
    busy: float = 0.0
    answered_seq: int = 0
    drained_at: float = 0.0
    empty_since: float | None = None
    every: float = 0.0  # > 0: a request of `depth` kernels this often
    next_request: float = 0.0
    to_launch: int = 0  # of the request under way
    requests: list[Request] = field(default_factory=list)
    last_launch: float = float("-inf")
    emptied_at: float = 0.0  # when its queue last ran empty
    idle_since: float | None = None  # its idle report: when it went idle
    idle_rang: bool = False  # the report has been rung for
    # > 0: each kernel's length drawn from kernel * (1 +- spread), uniformly,
    # by a generator seeded with `seed` (the same run every time)
    spread: float = 0.0
    seed: int = 0
    lengths: random.Random | None = None

    def length(self) -> float:
        """The next kernel's length."""
        if self.spread <= 0:
            return self.kernel
        if self.lengths is None:
            self.lengths = random.Random(self.seed)
        return self.kernel * self.lengths.uniform(1 - self.spread, 1 + self.spread)


@dataclass
class Request:
    """One request of a serving process: from its start to its last kernel's end."""

    start: float
    started_with: dict[int, int]  # each process's (by index) completed kernels at start
    end: float | None = None
    ended_with: dict[int, int] = field(default_factory=dict)

    def ran_meanwhile(self, index: int) -> int:
        """Kernels process `index` completed while this request was under way."""
        return self.ended_with[index] - self.started_with[index]


def run(scheduler: SliceScheduler, procs: list[Proc], duration: float, *,
        demand: Callable[[float, str], bool] = lambda t, name: True,
        dt: float = 0.0001, timeslice: float = 0.002, answer_delay: float = 0.0002,
        step_delay: float = 0.0003, on_step: Callable[[float], None] | None = None,
        ) -> dict[str, int]:
    """Run `duration` seconds; completed kernels per container.

    `demand(t, name)`: whether that container's processes want to launch at t."""
    names = sorted({p.container for p in procs})
    open_: frozenset[str] = frozenset()  # gates a launch passes: open or armed
    armed: frozenset[str] = frozenset()
    rung: set[int] = set()  # processes whose launch through their armed gate rang
    close_seq = dict.fromkeys(names, 0)
    closed_at: dict[str, float] = {}
    running: Proc | None = None
    slice_left = timeslice
    rr = 0
    wake_at = 0.0
    pending_step: float | None = 0.0
    was_waiting = dict.fromkeys(names, False)
    watched: str | None = None  # the holder the decision watches for going idle
    rests = ProcessRests()  # as the dispatcher's port keeps them
    by_name: dict[str, list[Proc]] = {name: [p for p in procs if p.container == name]
                                      for name in names}
    t = 0.0

    def completed() -> dict[int, int]:
        return {i: p.completed for i, p in enumerate(procs)}

    while t < duration:
        # requests begin; processes launch while their gate is open (the first launch
        # of each process through an armed gate rings)
        armed_rang = False
        for p in procs:
            if p.every > 0 and p.to_launch == 0 and not p.queue and (
                    not p.requests or p.requests[-1].end is not None) and (
                    t >= p.next_request):
                p.requests.append(Request(t, completed()))
                p.to_launch = p.depth
                while p.next_request <= t:
                    p.next_request += p.every
            if p.container not in open_:
                continue
            if p.container in armed and id(p) not in rung and (
                    p.to_launch or (p.every == 0 and demand(t, p.container)
                                    and len(p.queue) < p.depth)):
                rung.add(id(p))
                armed_rang = True
            launched = p.launches
            if p.every > 0:
                p.queue += [p.length() for _ in range(p.to_launch)]
                p.launches += p.to_launch
                p.to_launch = 0
            elif demand(t, p.container):
                while len(p.queue) < p.depth:
                    p.queue.append(p.length())
                    p.launches += 1
            if p.launches != launched:
                p.last_launch, p.idle_since = t, None
        # the GPU: one process at a time, round robin in time slices
        if running is not None and (not running.queue or slice_left <= 0):
            running = None
        if running is None:
            for step in range(1, len(procs) + 1):
                candidate = procs[(rr + step) % len(procs)]
                if candidate.queue:
                    running, rr, slice_left = candidate, (rr + step) % len(procs), timeslice
                    break
        if running is not None:
            running.queue[0] -= dt
            running.busy += dt
            slice_left -= dt
            if running.queue[0] <= 1e-12:
                running.queue.pop(0)
                running.completed += 1
                if not running.queue:
                    running.emptied_at = t + dt
                if running.every > 0 and not running.queue and not running.to_launch:
                    request = running.requests[-1]
                    request.end, request.ended_with = t + dt, completed()
        t += dt
        # drain answers: a process answers once its queue is empty after a close
        rang = armed_rang
        for p in procs:
            seq = close_seq[p.container]
            if p.answered_seq == seq or p.queue:
                p.empty_since = None
                continue
            if p.empty_since is None:
                p.empty_since = max(t, closed_at[p.container])
            if t >= p.empty_since + answer_delay:
                p.answered_seq, p.drained_at = seq, p.empty_since
                rang = True
        grace = scheduler.idle_grace
        for p in by_name.get(watched, []) if watched is not None else ():
            if (p.launches and p.idle_since is None and not p.queue and not p.to_launch
                    and t >= max(p.last_launch + grace, p.emptied_at) + answer_delay):
                p.idle_since, p.idle_rang = max(p.last_launch, p.emptied_at), False
            if p.idle_since is not None and not p.idle_rang and (
                    t >= p.idle_since + grace + answer_delay):
                p.idle_rang = rang = True
        for name, mine in by_name.items():
            wants = any(p.to_launch for p in mine) or (
                demand(t, name) and any(p.every == 0 for p in mine))
            # As libcgpu reports it: at the closed gate, or (a busy process) held
            # at its in-flight bound; a request's synchronize is no wait.
            waiting = (wants and name not in open_) or any(
                p.queue for p in mine if p.every == 0)
            if waiting and not was_waiting[name]:
                rang = True
            was_waiting[name] = waiting
        if rang and pending_step is None:
            pending_step = t + step_delay
        if t >= wake_at or (pending_step is not None and t >= pending_step):
            pending_step = None
            observed = {}
            for name, mine in by_name.items():
                watching = [p for p in mine if p.launches]
                busy_wants = demand(t, name) and name not in open_
                said = [p.idle_since for p in watching]
                idle = (name == watched and bool(said) and not was_waiting[name]
                        and all(since is not None for since in said))
                observed[name] = Observation(
                    idle=idle, active_at=max(s for s in said if s is not None) if idle else None,
                    waiting=was_waiting[name],
                    launches=sum(p.launches for p in mine),
                    answered=all(p.answered_seq == close_seq[name] for p in watching),
                    process_rest=max(rests.look(id(p), p.launches, bool(
                        p.to_launch or (p.every == 0 and (p.queue or busy_wants))), t)
                        for p in mine),
                )
            rests.end_round()
            decision = scheduler.step(t, observed)
            passing = decision.open | decision.armed
            rung -= {id(p) for p in procs if p.container in decision.armed - armed}
            armed = decision.armed
            watch = decision.idle_watch
            new_watched = watch.holder if watch is not None and watch.holder in passing else None
            if new_watched != watched:  # a report stands only while it is asked for
                for p in procs:
                    p.idle_since = None
                watched = new_watched
            for name in open_ - passing:
                close_seq[name] += 1
                closed_at[name] = t
            open_ = passing
            # as the dispatcher: a watched holder's processes say when it went idle
            wake_at = max(decision.wake_at if watch is None else watch.otherwise,
                          t + step_delay)
            if on_step is not None:
                on_step(t)
    return {name: sum(p.completed for p in procs if p.container == name) for name in names}


def kernels(counts: Mapping[str, int], procs: list[Proc]) -> dict[str, float]:
    """Completed kernels in seconds of GPU work per container (`counts` names them)."""
    work = dict.fromkeys(counts, 0.0)
    for p in procs:
        work[p.container] += p.completed * p.kernel
    return work
