"""The compute check's rules (pure): GPU time a container used, as the driver saw
it, against the spans in which the scheduler let it run.

libcgpu holds every launch at the container's gate, but code in a process can
step around it (a second copy of the driver, the driver's entry points read
from its symbol table). NVML samples each process's use of the GPU
(`nvmlDeviceGetProcessUtilization`: per sample period, the percent of the
period in which a kernel of that process ran), coarsely: a period is about
1/6 s, many turns long, and a process's figure may read from about 0.7 to 1.4
times what it ran (`simgpu` imitates both). So:

- over its grants: a container's samples in the last `window` seconds, all
  its processes together, add up to more than `tolerance` times the seconds
  in which it might have run, plus `slack` of the window. A cap
  (`util_limit`) bounds its grants, so this holds it to its cap too;
- past its grants: a sample of one process reads more than `tolerance` times
  what its container might have run in that sample's period (widened by the
  uncertainty of where the period lay), by more than `excess_min` seconds
  over the window. In a period in which the container might not run at all,
  no factor makes use out of nothing. A sample that reaches past the step
  that armed the container's gate waits for the next step: a launch through
  the armed gate shows only then, and counts from the arming step on.

The first rule cannot see a process that reads low and steals less than
half again of a busy container's grants: nearly every period of a busy
container holds a grant. So the check asks for audits (`audits_wanted`): a
quiet span of `audit_length` (2.5 periods: one whole period with its
margins falls in it, wherever the periods lie) in which the container is
granted nothing while another holds the GPU, so that the second rule sees
every process of it with nothing to hide behind. An audit costs the
container a short wait (it takes the time back after), so it is asked for
only on a sign: a process that ran on the GPU but launched nothing through
the gate (or whose library found the driver's entry points taken), a
container over its grants whose every process launched through the gate,
a busy container whose samples rose by more than `rise` against its grants
over the least they were since its last audit, and a busy container that
has had none for `audit_every` seconds (a process that forges its launch
counter and steals little is found no sooner). A span in which a container
rested counts as an audit too.

The processes to stop are those whose use the gate did not hand out: with
the second rule, those whose samples exceeded; with the first, those that
launched nothing through the gate in the window (or whose library found the
driver's entry points taken), the largest first, until their use covers the
excess. When every process of a container over its grants launched through
the gate, none is judged: an audit is asked for, and the second rule names
the one that ran in it. A process once judged is left out of later windows.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field
from functools import partial

from cgpu_km.sched.grants import GrantHistory

__all__ = ["DEFAULT_PERIOD", "Judge", "Sample", "Verdict"]

Key = tuple[int, str]  # a container on a GPU, as cgpu_km.tree.views names it
DEFAULT_PERIOD = 1 / 6  # the shortest sample period NVML documents (the longest: 1 s)
MIN_PERIOD, MAX_PERIOD = 0.02, 1.0
SUSPECT_FOR = 0.25  # a process suspected this long is audited


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
    past: float = 0.0  # seconds sampled past what the periods' grants allow
    ungranted: bool = False  # some of it in periods with no grant at all

    def describe(self) -> str:
        if self.ungranted:
            return (f"used {self.past:.2f} s of GPU time in the last {self.window:.1f} s "
                    f"while it held no grant (NVML per-process utilization)")
        if self.past:
            return (f"used {self.past:.2f} s of GPU time in the last {self.window:.1f} s "
                    f"past its grants (NVML per-process utilization)")
        return (f"used {self.used:.2f} s of GPU time in the last {self.window:.1f} s "
                f"while granted {self.allowed:.2f} s (NVML per-process utilization)")


@dataclass
class _Gpu:
    samples: collections.deque[Sample] = field(default_factory=collections.deque)
    last_end: dict[int, float] = field(default_factory=dict)  # pid -> its last sample's end
    spacings: collections.deque[float] = field(default_factory=lambda: collections.deque(
        maxlen=64))


@dataclass
class _Audited:
    """A container's audits: when it last passed one, who ran then, how its
    samples stood against its grants before it."""

    passed_at: float
    pids: set[int] = field(default_factory=set)
    # Its samples and grants, in seconds, in the spans up to `tallied_to`: those
    # of the last `rise_window` one by one, and the sum of those before, back to
    # its last audit. A sum, not the least of a series: the least only falls,
    # and an honest container's use of its grants swings with its host's CPU.
    tallied_to: float | None = None
    recent: collections.deque[tuple[float, float, float, float]] = field(
        default_factory=collections.deque)  # (from, to, used, allowed)
    before: tuple[float, float] = (0.0, 0.0)  # (used, allowed)
    suspected: dict[int, float] = field(default_factory=dict)  # pid -> since when
    asked_at: float = -math.inf

    def restart_tally(self) -> None:
        """Its samples and grants are counted afresh from here."""
        self.recent.clear()
        self.before = (0.0, 0.0)


class Judge:
    """Samples in, verdicts and audits wanted out; one per daemon, for every GPU."""

    def __init__(self, *, window: float = 2.0, tolerance: float = 1.5, slack: float = 0.05,
                 excess_min: float = 0.02, rise: float = 1.25, rise_window: float = 6.0,
                 audit_every: float = 300.0) -> None:
        self.window = window
        self.tolerance = tolerance
        self.slack = slack
        self.excess_min = excess_min
        self.rise = rise
        self.rise_window = rise_window
        self.audit_every = audit_every
        self._gpus: dict[int, _Gpu] = {}
        self._judged: set[tuple[Key, int]] = set()
        self._audited: dict[Key, _Audited] = {}
        self._wanted: dict[int, dict[Key, str]] = {}  # gpu -> container -> why

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

    def audit_length(self, gpu: int) -> float:
        """A quiet span that holds one whole sample period with its margins,
        wherever the periods fall."""
        return 2.5 * self.periods(gpu)[1]

    def add(self, gpu: int, samples: list[Sample]) -> None:
        """New samples of `gpu` (each read once: NVML's lastSeenTimeStamp)."""
        state = self._gpus.setdefault(gpu, _Gpu())
        for sample in sorted(samples, key=lambda s: s.end):
            before = state.last_end.get(sample.pid)
            if before is not None and sample.end - before >= MIN_PERIOD:
                state.spacings.append(sample.end - before)
            state.last_end[sample.pid] = sample.end
            state.samples.append(sample)

    def audits_wanted(self, gpu: int) -> Mapping[Key, str]:
        """The containers of `gpu` the last `judge` wants audited, and why."""
        return dict(self._wanted.get(gpu, {}))

    def judge(self, gpu: int, now: float, grants: GrantHistory,
              launched_at: Mapping[tuple[Key, int], float | None],
              hijacked: Set[tuple[Key, int]] = frozenset()) -> list[Verdict]:
        """The containers of `gpu` over their grants in the window that ends at
        `now` (shorter for a container known for less: `GrantHistory.known_from`).
        `launched_at`: when each process's slot last counted a launch through
        the gate (None: never; a process with no slot is the bypass check's);
        `hijacked`: those whose libcgpu reported the driver's entry points
        taken."""
        state = self._gpus.get(gpu)
        self._wanted[gpu] = {}
        if state is None:
            return []
        # Samples are judged as they come; a window still missing some of its
        # samples only reads less. A quiet span counts for an audit once every
        # sample of a period within it has come (a period after its end).
        end = now
        begin = end - self.window
        keep = end - self.window - max(self.window, self.audit_length(gpu))
        while state.samples and state.samples[0].end <= keep:
            state.samples.popleft()
        state.last_end = {pid: t for pid, t in state.last_end.items() if t > keep}
        starts, used, past, ungranted = self._tally(gpu, state, grants, begin, end)
        verdicts = []
        over_grants: dict[Key, bool] = {}  # over, but no process to blame
        longest = self.periods(gpu)[1]
        for key, by_pid in sorted(used.items()):
            allowed = grants.allowed(key[1], starts[key] - longest, end)
            if allowed is None:
                continue  # the gates may have failed open, or nothing is known yet
            total = sum(by_pid.values())
            over = past.get(key, {})
            excess = total - self.tolerance * allowed - self.slack * (end - starts[key])
            if sum(over.values()) > self.excess_min:
                verdict = Verdict(key, tuple(sorted(over)), total, allowed, end - starts[key],
                                  past=sum(over.values()), ungranted=key in ungranted)
            elif excess > 0 and (pids := self._culprits(key, by_pid, excess, begin,
                                                          launched_at, hijacked)):
                verdict = Verdict(key, pids, total, allowed, end - starts[key])
            else:
                over_grants[key] = excess > 0
                continue
            self._judged.update((key, pid) for pid in verdict.pids)
            verdicts.append(verdict)
        judged = {v.key for v in verdicts}
        for key in sorted({s.key for s in state.samples if s.end > begin} - judged):
            self._audit(gpu, key, grants, state, begin, now,
                        partial(self._suspect, key, begin, launched_at, hijacked),
                        over_grants.get(key, False))
        live = {(s.key, s.pid) for s in state.samples}
        self._judged = {judged for judged in self._judged
                        if judged in launched_at or judged in live}
        seen = {key for key, _pid in live}
        self._audited = {key: a for key, a in self._audited.items()
                         if key[0] != gpu or key in seen}
        return verdicts

    def _tally(self, gpu: int, state: _Gpu, grants: GrantHistory, begin: float, end: float
               ) -> tuple[dict[Key, float], dict[Key, dict[int, float]],
                          dict[Key, dict[int, float]], set[Key]]:
        """Each container's window (from `begin`, or from when it is known), the
        seconds its processes' samples in it add up to, those past their
        periods' grants, and the containers some of it ran with no grant."""
        period, longest = self.periods(gpu)
        margin = longest / 4
        starts: dict[Key, float] = {}
        used: dict[Key, dict[int, float]] = {}
        past: dict[Key, dict[int, float]] = {}
        ungranted: set[Key] = set()
        for sample in state.samples:
            key, pid = sample.key, sample.pid
            if key not in starts:
                known = grants.known_from(key[1])
                starts[key] = end if known is None else max(begin, known + longest)
            if not starts[key] < sample.end <= end or (key, pid) in self._judged:
                continue
            seconds = sample.percent / 100 * period
            mine = used.setdefault(key, {})
            mine[pid] = mine.get(pid, 0.0) + seconds
            near = grants.allowed(key[1], sample.end - longest - margin, sample.end + margin)
            if near is None or seconds <= self.tolerance * near:
                continue
            if not grants.settled(key[1], sample.end + margin):
                continue  # through an armed gate? the next step tells: judged then
            over = past.setdefault(key, {})
            over[pid] = over.get(pid, 0.0) + seconds - self.tolerance * near
            if near == 0.0:
                ungranted.add(key)
        return starts, used, past, ungranted

    def _audit(self, gpu: int, key: Key, grants: GrantHistory, state: _Gpu, begin: float,
               now: float, suspect: Callable[[int], bool], over: bool) -> None:
        """Whether `key` wants an audit (`over`: over its grants, but every process
        of it launched through the gate), unless it passed one since: a quiet
        span long enough, covered by samples that came, and nothing judged."""
        audited = self._audited.get(key)
        if audited is None:
            audited = self._audited[key] = _Audited(passed_at=now)
        if not state.spacings:
            return  # no period known yet: an audit would have to be a second long
        length = self.audit_length(gpu)
        arrived = now - self.periods(gpu)[1]
        ratio, baseline, busy = self._ratios(key, grants, state, arrived, audited)
        why = self._why(key, state, begin, now, suspect, over, ratio, baseline, busy,
                        audited)
        if why is not None:  # a sign: did it pass an audit (or rest) since?
            since = max(audited.passed_at, begin - length)
            for start, stop in reversed(grants.quiet(key[1], since, arrived)):
                if stop - start >= length:
                    audited.passed_at = stop
                    audited.pids = {s.pid for s in state.samples
                                    if s.key == key and s.end <= stop}
                    audited.restart_tally()
                    why = self._why(key, state, begin, now, suspect, over, ratio, None,
                                    busy, audited)
                    break
        # An audit asked for is under way, or not yet seen whole by the samples.
        waiting_for = length + 2 * self.periods(gpu)[1] + 0.5
        if why is not None and now - audited.asked_at > waiting_for:
            audited.asked_at = now
            self._wanted[gpu][key] = why

    def _why(self, key: Key, state: _Gpu, begin: float, now: float,
             suspect: Callable[[int], bool], over: bool, ratio: float | None,
             baseline: float | None, busy: bool, audited: _Audited) -> str | None:
        """The sign that `key` wants an audit, if any (see the module's docstring)."""
        ran = {s.pid for s in state.samples if s.key == key and s.end > begin}
        # Suspects an audit has not seen, suspected for a while (a process that has
        # only just started may have run before its first launch was counted).
        suspects = {pid for pid in ran - audited.pids if suspect(pid)}
        audited.suspected = {pid: audited.suspected.get(pid, now) for pid in suspects}
        unseen = {pid for pid, since in audited.suspected.items()
                  if now - since >= SUSPECT_FOR}
        if over:
            return "over its grants, every process of it launching through the gate"
        if unseen:
            return f"pid {min(unseen)} ran on the GPU but launched nothing through the gate"
        if ratio is not None and baseline is not None and baseline >= 0.1 and (
                ratio > self.rise * baseline + 0.1):
            return f"its samples rose from {baseline:.2f} to {ratio:.2f} of its grants"
        if busy and now - audited.passed_at > self.audit_every:
            return f"none for {self.audit_every:g} s"
        return None

    def _ratios(self, key: Key, grants: GrantHistory, state: _Gpu, arrived: float,
                audited: _Audited) -> tuple[float | None, float | None, bool]:
        """A busy container's samples against its grants over the last `rise_window`
        that ends where every sample has come, and over the time from its last
        audit until then (each None unless it was granted a fifth of its span,
        the first also unless its spans cover it whole); and whether it is busy:
        known the whole last `window` and granted a fifth of it. A blind span, or
        a gap longer than the samples kept, starts them over."""
        since, audited.tallied_to = audited.tallied_to, arrived
        if since is not None and since < arrived:
            allowed = (grants.allowed(key[1], since, arrived)
                       if arrived - since <= self.window else None)
            if allowed is None:
                audited.restart_tally()
            else:
                period = self.periods(key[0])[0]
                used = sum(s.percent / 100 * period for s in state.samples
                           if s.key == key and since < s.end <= arrived)
                audited.recent.append((since, arrived, used, allowed))
        while audited.recent and audited.recent[0][1] <= arrived - self.rise_window:
            _since, _to, used, allowed = audited.recent.popleft()
            audited.before = (audited.before[0] + used, audited.before[1] + allowed)

        def over(seconds: float) -> tuple[float, float] | None:
            """Samples and grants over the last `seconds`, if the spans cover them."""
            if not audited.recent or audited.recent[0][0] > arrived - seconds:
                return None
            spans = [span for span in audited.recent if span[1] > arrived - seconds]
            return sum(span[2] for span in spans), sum(span[3] for span in spans)

        rise, last = over(self.rise_window), over(self.window)
        ratio = None
        if rise is not None and rise[1] >= 0.2 * self.rise_window:
            ratio = rise[0] / rise[1]
        baseline = None
        if audited.before[1] >= 0.2 * self.rise_window:
            baseline = audited.before[0] / audited.before[1]
        return ratio, baseline, last is not None and last[1] >= 0.2 * self.window

    @staticmethod
    def _suspect(key: Key, begin: float, launched_at: Mapping[tuple[Key, int], float | None],
                 hijacked: Set[tuple[Key, int]], pid: int) -> bool:
        """Whether the gate did not hand out what `pid` ran: it launched nothing
        through the gate since `begin`, or its library found the driver's entry
        points taken."""
        at = launched_at.get((key, pid))
        return (key, pid) in hijacked or at is None or at < begin

    def _culprits(self, key: Key, by_pid: Mapping[int, float], excess: float, begin: float,
                  launched_at: Mapping[tuple[Key, int], float | None],
                  hijacked: Set[tuple[Key, int]]) -> tuple[int, ...]:
        """The suspects (`_suspect`), the largest first, until their use covers
        `excess`; never a process that launched through the gate (an audit
        tells those apart)."""
        suspect = partial(self._suspect, key, begin, launched_at, hijacked)
        chosen: list[int] = []
        covered = 0.0
        for pid in sorted(filter(suspect, by_pid), key=lambda p: (-by_pid[p], p)):
            if covered >= excess:
                break
            chosen.append(pid)
            covered += by_pid[pid]
        return tuple(sorted(chosen))
