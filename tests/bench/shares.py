"""Compute shares counted by the workloads themselves.

Each container is a `cgpu-run` job running `simgpu/sharework`, which counts
the kernels its processes complete in 10 ms buckets of CLOCK_MONOTONIC from
a start time that every container of a run shares. What a container got is
what it completed: no figure here comes from NVML, the daemon or the
scheduler.

The arithmetic is pure (`parse_report`, `count`, `window_starts`,
`window_counts`, `ratio_error`, `busy_fraction`, `summarize`); `started`
and `measure` run the jobs on a `Host`: a `SimHost` (simgpu), or the
real-GPU validation's (tests/gpu/harness.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Protocol

STEADY_AFTER = 1.0  # seconds from the start: the steady part
WINDOW = 1.0
WINDOW_STEP = 0.1
WINDOWS_AFTER = 0.5


# -- arithmetic --


@dataclass(frozen=True)
class Report:
    """What one workload completed: kernels per bucket from `t0` (CLOCK_MONOTONIC s)."""

    t0: float
    bucket: float
    buckets: tuple[int, ...]
    per_proc: tuple[int, ...]
    latency_us: tuple[int, ...] = ()  # each request's, in request mode

    @property
    def kernels(self) -> int:
        return sum(self.buckets)


def parse_report(text: str) -> Report:
    """The `counts`, `buckets` and `latency_us` lines of sharework's output (other lines
    are ignored)."""
    fields: dict[str, str] = {}
    buckets: tuple[int, ...] | None = None
    latency: tuple[int, ...] = ()
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["counts"]:
            for word in words[1:]:
                key, _, value = word.partition("=")
                fields[key] = value
        elif words[:1] == ["buckets"]:
            buckets = tuple(int(word) for word in words[1:])
        elif words[:1] == ["latency_us"]:
            latency = tuple(int(word) for word in words[1:])
    if not fields or buckets is None:
        raise ValueError(f"no counts in workload output: {text[-500:]!r}")
    per_proc = tuple(int(n) for n in fields["per_proc"].split(","))
    if sum(per_proc) != sum(buckets) or int(fields["kernels"]) != sum(buckets):
        raise ValueError(f"inconsistent counts: {fields}")
    return Report(t0=float(fields["t0"]), bucket=int(fields["bucket_ms"]) / 1000,
                  buckets=buckets, per_proc=per_proc, latency_us=latency)


def _index(report: Report, t: float) -> int:
    """The first bucket that starts at or after time `t` (clamped to the report)."""
    index = math.ceil(round((t - report.t0) / report.bucket, 6))
    return min(max(index, 0), len(report.buckets))


def count(report: Report, start: float, end: float) -> int:
    """Kernels completed in the buckets that start in [start, end) (absolute times)."""
    return sum(report.buckets[_index(report, start):_index(report, end)])


def window_starts(start: float, end: float, width: float, step: float) -> list[float]:
    """Starts of the windows [s, s + width) that fit in [start, end), `step` apart."""
    n = math.floor(round((end - start - width) / step, 6)) + 1
    return [start + k * step for k in range(max(n, 0))]


def window_counts(reports: Sequence[Report], start: float, end: float,
                  width: float = WINDOW, step: float = WINDOW_STEP) -> list[tuple[int, ...]]:
    """For each sliding window in [start, end): every report's count in it."""
    return [tuple(count(r, s, s + width) for r in reports)
            for s in window_starts(start, end, width, step)]


def ratio_error(first: int, second: int, target: float) -> float:
    """(second / first) / target - 1; infinite when `first` completed nothing."""
    if first == 0:
        return math.inf
    return second / first / target - 1


def busy_fraction(kernels: int, us: int, seconds: float) -> float:
    """The share of the GPU's time that `kernels` of `us` microseconds fill in `seconds`."""
    return kernels * us / 1e6 / seconds


def resolving_seconds(us: int, procs: int, share: float, error: float, least: float) -> float:
    """How long a run must be for its steady part to resolve a ratio `error`, for
    a container of `procs` processes of `us` kernels at `share` of the GPU (at
    least `least` seconds).

    Its kernels end in bursts of one per process (a time-sliced GPU runs the
    processes' kernels side by side, so they end together), so its count at
    each end of the steady part is uncertain by `procs` kernels: the steady
    part must hold 2 * procs / error of them.
    """
    kernels = 2 * procs / error
    return max(least, STEADY_AFTER + kernels * us / 1e6 / share)


@dataclass(frozen=True)
class Summary:
    """Two containers' counts over one run, against a target ratio second:first."""

    target: float
    seconds: float
    whole: tuple[int, int]
    steady: tuple[int, int]
    windows: tuple[tuple[int, int], ...]

    @property
    def whole_error(self) -> float:
        return ratio_error(*self.whole, self.target)

    @property
    def steady_error(self) -> float:
        return ratio_error(*self.steady, self.target)

    @property
    def worst_window_error(self) -> float:
        """The window error farthest from 0, with its sign."""
        errors = [ratio_error(a, b, self.target) for a, b in self.windows]
        return max(errors, key=abs, default=math.nan)

    @property
    def worst_window_points(self) -> float:
        """The window farthest from the target in the first container's share of
        the two, in percentage points, with its sign (a window where neither
        completed anything is left out)."""
        fair = 100 / (1 + self.target)
        points = [100 * a / (a + b) - fair for a, b in self.windows if a + b > 0]
        return max(points, key=abs, default=math.nan)

    def rates(self) -> tuple[float, float]:
        """Kernels per second of each over the whole run."""
        return (self.whole[0] / self.seconds, self.whole[1] / self.seconds)


def summarize(first: Report, second: Report, seconds: float, target: float) -> Summary:
    """Whole run, steady part (from STEADY_AFTER) and sliding windows (from WINDOWS_AFTER)."""
    t0 = max(first.t0, second.t0)
    end = t0 + seconds

    def pair(start: float) -> tuple[int, int]:
        return (count(first, start, end), count(second, start, end))

    windows = window_counts([first, second], t0 + WINDOWS_AFTER, end)
    return Summary(target=target, seconds=seconds, whole=pair(t0),
                   steady=pair(t0 + STEADY_AFTER),
                   windows=tuple((a, b) for a, b in windows))


# -- running workloads --


@dataclass(frozen=True)
class Workload:
    """One container: `procs` sharework processes of `us` kernels under `cgpu-run`."""

    name: str
    us: int
    procs: int = 1
    gpu: int = 0
    weight: int | None = None
    highprio: bool = False
    util_limit: int | None = None
    depth: int = 2
    streams: int = 1
    request_ms: int = 0  # > 0: a request of `depth` kernels every this many ms per process
    phase_ms: int = 0  # the first request's offset from the start


class Host(Protocol):
    """Where containers run: `cgpu-run` against a control tree and its daemon."""

    @property
    def sharework(self) -> Path:
        """The sharework binary to run in the containers."""

    def cgpu_run(self, name: str, command: list[str], *, gpu: int = 0,
                 weight: int | None = None, highprio: bool = False,
                 util_limit: int | None = None, stdin: int | IO[bytes] | None = None,
                 stdout: int | IO[bytes] | None = None) -> subprocess.Popen[bytes]:
        """`cgpu-run --name NAME [...] -- COMMAND`, in its own process group."""

    def log(self, name: str) -> str:
        """What the container wrote to its log so far."""

    def stop(self, name: str) -> None:
        """Stop the container, and forget it."""


class Job:
    """A running container: `cgpu-run ... -- sharework --go-stdin`."""

    def __init__(self, host: Host, workload: Workload, seconds: float) -> None:
        self.host = host
        self.workload = workload
        command = [str(host.sharework), "--us", str(workload.us), "--seconds", str(seconds),
                   "--procs", str(workload.procs), "--depth", str(workload.depth),
                   "--streams", str(workload.streams), "--request-ms",
                   str(workload.request_ms), "--phase-ms", str(workload.phase_ms),
                   "--go-stdin"]
        self.process = host.cgpu_run(
            workload.name, command, gpu=workload.gpu, weight=workload.weight,
            highprio=workload.highprio, util_limit=workload.util_limit,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.out = b""

    def _failed(self, why: str) -> RuntimeError:
        return RuntimeError(f"{self.workload.name}: {why}: {self.host.log(self.workload.name)}")

    def wait_ready(self, deadline: float) -> None:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while b"ready" not in self.out:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._failed("not ready in time")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise self._failed(f"exited before ready ({self.out.decode()!r})")
                self.out += chunk

    def go(self, at: float) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"go {at:.9f}\n".encode())
        self.process.stdin.flush()

    def report(self, timeout: float) -> Report:
        """Wait for the end; the workload's counts."""
        try:
            out, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise self._failed("did not finish in time") from None
        if self.process.returncode != 0:
            raise self._failed(f"exit status {self.process.returncode}")
        return parse_report((self.out + out).decode())


@dataclass
class Run:
    """Containers started together at `t0` for `seconds`."""

    t0: float
    seconds: float
    jobs: dict[str, Job]

    def sleep_until(self, offset: float) -> float:
        """Sleep until `t0 + offset`; returns that time."""
        at = self.t0 + offset
        time.sleep(max(0.0, at - time.monotonic()))
        return at

    def reports(self) -> dict[str, Report]:
        """Wait for every workload's end and parse its counts."""
        left = self.t0 + self.seconds - time.monotonic()
        return {name: job.report(timeout=max(left, 0) + 60) for name, job in self.jobs.items()}


@contextlib.contextmanager
def started(host: Host, workloads: Sequence[Workload], seconds: float, *,
            delay: float = 0.5) -> Iterator[Run]:
    """Start every container, wait until all are ready, and give them one start time
    `delay` ahead (time for the daemon to attach their regions); stops what is left."""
    jobs: dict[str, Job] = {}
    try:
        for workload in workloads:
            jobs[workload.name] = Job(host, workload, seconds)
        deadline = time.monotonic() + 60
        for job in jobs.values():
            job.wait_ready(deadline)
        t0 = time.monotonic() + delay
        for job in jobs.values():
            job.go(t0)
        yield Run(t0, seconds, jobs)
    finally:
        for name in jobs:
            host.stop(name)


def measure(host: Host, workloads: Sequence[Workload], seconds: float,
            suffix: str = "") -> dict[str, Report]:
    """Run the containers together for `seconds`; their reports by workload name.
    The containers are named NAME + `suffix` (a container's name is taken until
    its cleanup is done)."""
    named = [replace(w, name=w.name + suffix) for w in workloads]
    with started(host, named, seconds) as run:
        reports = run.reports()
    return {w.name: reports[n.name] for w, n in zip(workloads, named, strict=True)}


def fraction(report: Report, us: int, start: float, end: float) -> float:
    """The share of the GPU's time that `report`'s `us` kernels filled in [start, end)."""
    return busy_fraction(count(report, start, end), us, end - start)
