"""The soak's figures, pure: growth, shares, recovery, errors.

Every share here is counted from the pairs' workloads (sharework's kernels per
10 ms bucket), never from the daemon's own figures.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tests.bench.shares import Report

TARGET = 0.05  # a pair's ratio within 5% of its policy's
# A window resolves the target when the smaller workload held the GPU this long in
# it: 50 slices of 20 ms, so that one slice more or less is 2% of its count.
RESOLVING = 1.0
SETTLE = 3.0  # seconds after a fault ends or a write, before a window counts as steady
CHURN_SETTLE = 1.0  # seconds after a container arrives on or leaves the GPU
BUSY_STEP = 0.25  # a workload is busy in a window when it completes kernels in every step
RECOVERY_WINDOW = 2.0  # recovered: the next 2 s within the target, both busy every 0.5 s
LOG_WINDOW = 30.0  # how long after a fault its log lines count as its own
# Error lines a fault explains (daemon log; matched anywhere in the line).
EXPLAINED = {
    "fuse-kill": ("tree", "Transport endpoint", "Errno 107", "Errno 2", "ENOTCONN"),
}
ERROR = re.compile(r"^cgpu-daemon: (ERROR|CRITICAL): |^Traceback ")


def fit_slope(points: Sequence[tuple[float, float, int]]) -> float | None:
    """Least-squares slope of value over time with an intercept of each segment's own:
    (time, value, segment). None with fewer than two distinct times in any segment."""
    by_segment: dict[int, list[tuple[float, float]]] = {}
    for t, y, segment in points:
        by_segment.setdefault(segment, []).append((t, y))
    top = bottom = 0.0
    for pairs in by_segment.values():
        mean_t = sum(t for t, _ in pairs) / len(pairs)
        mean_y = sum(y for _, y in pairs) / len(pairs)
        top += sum((t - mean_t) * (y - mean_y) for t, y in pairs)
        bottom += sum((t - mean_t) ** 2 for t, _ in pairs)
    return top / bottom if bottom > 0 else None


def peaks(points: Sequence[tuple[float, float, int]]) -> list[tuple[float, float]]:
    """Each segment's (time, value) at its highest value, in time order: a figure that
    a warm-up after each restart does not inflate, unlike a fit within segments."""
    best: dict[int, tuple[float, float]] = {}
    for t, y, segment in points:
        if segment not in best or y > best[segment][1]:
            best[segment] = (t, y)
    return sorted(best.values())


def segments(times: Sequence[float], boundaries: Sequence[float], warmup: float
             ) -> list[int | None]:
    """Each time's segment between `boundaries` (restarts), None within `warmup` s after
    the start or a boundary."""
    marks = sorted(boundaries)
    found: list[int | None] = []
    for t in times:
        index = sum(1 for b in marks if b <= t)
        since = t - (marks[index - 1] if index else 0.0)
        found.append(index if since >= warmup else None)
    return found


def count(report: Report, start: float, end: float) -> int:
    """Kernels completed in [start, end) (CLOCK_MONOTONIC s); whole buckets only."""
    first = max(0, math.ceil(round((start - report.t0) / report.bucket, 6)))
    last = min(len(report.buckets), math.floor(round((end - report.t0) / report.bucket, 6)))
    return sum(report.buckets[first:last]) if last > first else 0


def busy(report: Report, start: float, end: float, step: float = BUSY_STEP) -> bool:
    """Whether it completed kernels in every `step` of [start, end)."""
    t = start
    while t + step <= end + 1e-9:
        if count(report, t, t + step) == 0:
            return False
        t += step
    return True


def ratio_error(first: int, second: int, expected: float) -> float:
    """(second/first) / expected - 1; inf when the first completed nothing."""
    return math.inf if first == 0 else second / first / expected - 1


@dataclass(frozen=True)
class Window:
    """A steady span of one GPU's pair, and its ratio's error against the policy's."""

    gpu: int
    start: float  # seconds from the soak's start
    seconds: float
    expected: float
    error: float
    kernels: tuple[int, int] = (0, 0)  # the first workload's, the second's
    audits: int = 0  # audits the daemon logged on the GPU in or about the window
    late_ms: float | None = None  # how late its dispatcher woke for deadlines, mean
    kernel: float = 0.0  # seconds, each kernel of the pair's workloads (0: not known)

    @property
    def held(self) -> bool:
        return abs(self.error) <= TARGET

    @property
    def unjudged(self) -> str:
        """Why the window is shown but not judged; "" when it is judged. An audit
        bars a container for a while and gives the time back after, perhaps past
        the window's end (audits of honest containers are a figure of their own);
        a window in which the smaller workload held the GPU for less than
        RESOLVING seconds cannot tell 5% from a slice more or less."""
        if self.audits:
            return "an audit"
        if self.kernel and min(self.kernels) * self.kernel < RESOLVING:
            return f"under {RESOLVING:g} s of GPU time for the smaller workload"
        return ""


def pooled(windows: Sequence[Window], shortest: float = 0.0
           ) -> dict[tuple[int, float], float]:
    """Each GPU's ratio error over all its steady windows of one expected ratio, their
    kernels summed, where they last `shortest` s in all: (GPU, expected) -> error.
    Windows with an audit are left out (see `Window.unjudged`)."""
    sums: dict[tuple[int, float], tuple[int, int, float]] = {}
    for w in windows:
        if w.audits:
            continue
        one, two, seconds = sums.get((w.gpu, w.expected), (0, 0, 0.0))
        sums[(w.gpu, w.expected)] = (one + w.kernels[0], two + w.kernels[1],
                                     seconds + w.seconds)
    return {key: ratio_error(one, two, key[1]) for key, (one, two, seconds) in sums.items()
            if seconds >= shortest}


def steady_windows(first: Report, second: Report, gpu: int, t0: float,
                   span: tuple[float, float], shortest: float,
                   quiet: Callable[[float, float], bool],
                   expected: Callable[[float], float | None],
                   step: float = 0.5) -> list[Window]:
    """The steady windows in `span` (seconds from the soak's start): each a longest run
    of `step`s, at least `shortest` s in all, that are quiet (`quiet(start, end)`: no
    fault, write or restart near), where both workloads completed kernels in every
    `BUSY_STEP` and the policy's ratio stayed the same; each with its ratio's error."""
    found = []
    run: list[float] = []

    def close() -> None:
        if run and len(run) * step >= shortest - 1e-9:
            a, b = t0 + run[0], t0 + run[-1] + step
            want = expected(run[0])
            assert want is not None
            one, two = count(first, a, b), count(second, a, b)
            found.append(Window(gpu, run[0], len(run) * step, want, ratio_error(one, two, want),
                                (one, two)))
        run.clear()

    start = span[0]
    while start + step <= span[1] + 1e-9:
        end = start + step
        want = expected(start)
        steady = (want is not None and want == expected(end - 1e-6) and quiet(start, end)
                  and busy(first, t0 + start, t0 + end) and busy(second, t0 + start, t0 + end))
        if steady and run and expected(run[0]) != want:
            close()
        if steady:
            run.append(start)
        else:
            close()
        start = end
    close()
    return found


def recovery(first: Report, second: Report, t0: float, at: float, until: float,
             expected: Callable[[float], float | None]) -> float | None:
    """Seconds from `at` (from the soak's start) to the first time whose next 2 s have
    both workloads busy (in every 0.5 s) and their ratio within the target; None if
    that never happens before `until`."""
    t = at
    while t + RECOVERY_WINDOW <= until:
        a, b = t0 + t, t0 + t + RECOVERY_WINDOW
        want = expected(t)
        if (want is not None and want == expected(t + RECOVERY_WINDOW)
                and busy(first, a, b, 0.5) and busy(second, a, b, 0.5)
                and abs(ratio_error(count(first, a, b), count(second, a, b), want)) <= TARGET):
            return round(t - at, 3)
        t += 0.1
    return None


def stall(first: Report, second: Report, t0: float, at: float, seconds: float = 15.0
          ) -> float:
    """The longest time in [at, at + seconds] in which either workload completed nothing."""
    longest = 0.0
    for report in (first, second):
        begin = max(0, math.floor((t0 + at - report.t0) / report.bucket))
        end = min(len(report.buckets), begin + round(seconds / report.bucket))
        gap = 0
        for n in report.buckets[begin:end]:
            gap = 0 if n else gap + 1
            longest = max(longest, gap * report.bucket)
    return round(longest, 3)


def timed_lines(text: str, sizes: Sequence[tuple[float, int]]) -> list[tuple[float, str]]:
    """Each line of a log with the first sample time at which the log held all of it
    (`sizes`: (time, bytes) in time order); lines past the last sample get its time."""
    found = []
    offset = 0
    index = 0
    last = sizes[-1][0] if sizes else 0.0
    for line in text.splitlines(keepends=True):
        offset += len(line.encode())
        while index < len(sizes) and sizes[index][1] < offset:
            index += 1
        found.append((sizes[index][0] if index < len(sizes) else last, line.rstrip("\n")))
    return found


def unexplained_errors(lines: Sequence[tuple[float, str]],
                       faults: Sequence[tuple[str, float]]) -> list[tuple[float, str]]:
    """Error lines (level ERROR or CRITICAL, or a traceback) that no fault explains: a
    fault explains a line logged within `LOG_WINDOW` s after it that names one of
    its kind's `EXPLAINED` texts."""
    found = []
    for at, line in lines:
        if not ERROR.search(line):
            continue
        explained = any(
            start - 1 <= at <= start + LOG_WINDOW and any(text in line for text in
                                                         EXPLAINED.get(kind, ()))
            for kind, start in faults)
        if not explained:
            found.append((at, line))
    return found


def mean_lateness(samples: Sequence[tuple[float, int, int, float]], start: float, end: float
                  ) -> float | None:
    """The mean lateness (ms) of a dispatcher's deadline wake-ups in [start, end], from
    samples (time, daemon pid, wake-ups so far, seconds late so far) of one GPU: the
    counters' growth between the last sample at or before `start` and the first at or
    after `end`, of one daemon; None where they do not bracket the span."""
    before = [s for s in samples if s[0] <= start]
    after = [s for s in samples if s[0] >= end]
    if not before or not after or before[-1][1] != after[0][1]:
        return None
    wakes = after[0][2] - before[-1][2]
    return 1e3 * (after[0][3] - before[-1][3]) / wakes if wakes > 0 else None


AUDITED = re.compile(r": container \S+ on GPU (\d+): audited for ")


def audits(lines: Sequence[tuple[float, str]], gpu: int, start: float, end: float) -> int:
    """Audits logged on `gpu` (timed lines) within a second of [start, end]."""
    return sum(1 for at, line in lines if start - 1 <= at <= end + 1
               and (found := AUDITED.search(line)) is not None and int(found[1]) == gpu)
