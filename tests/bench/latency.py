"""The latency part of `make bench`: how long an interactive container's requests wait.

An interactive container (`sharework --request-ms`) sends a request of 2 x
1 ms kernels every 20 ms and times each one itself, from its first launch
(the wait at the gate included) to the end of its synchronize. Beside it,
the neighbours of each row; every row runs under no scheduler (policy 5:
every gate open, simgpu's own time slicing between processes) and under
policies 1, 2 and 4, side by side in one run, with each latency figure's
ratio to no scheduler's. Shares are the GPU time the workloads' completed
kernels stand for, never a figure from the daemon.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tests.bench.shares import Report, Workload, busy_fraction

REQUEST_MS = 20
INTERACTIVE = Workload("int", 1000, depth=2, request_ms=REQUEST_MS)
BUSY = Workload("busy", 1000, depth=4)  # 1 ms kernels, 4 per synchronize
COLUMNS: tuple[tuple[str, int], ...] = (
    ("none", 5), ("policy 1", 1), ("policy 2", 2), ("policy 4", 4))
P99_TARGET = 1.5  # the interactive p99 against no scheduler's, policies 1, 2 and 4
ABOUT = (f"an interactive container sends a request of 2 x 1 ms kernels every {REQUEST_MS} ms, "
         f"each timed from its first launch to the end of its synchronize")
LEGEND = ("x = against none; int/nbrs = GPU time completed by the interactive containers / "
          "the neighbours")


@dataclass(frozen=True)
class Row:
    """One case: interactive containers and busy neighbours, all on GPU 0."""

    name: str
    interactive: tuple[Workload, ...]
    neighbours: tuple[Workload, ...] = ()

    def workloads(self) -> list[Workload]:
        named = [replace(w, name=f"int{i}") for i, w in enumerate(self.interactive)]
        named += [replace(w, name=f"nb{i}") for i, w in enumerate(self.neighbours)]
        return named


def interactive(count: int) -> tuple[Workload, ...]:
    """`count` interactive containers, their requests spread evenly over the 20 ms, the
    first 5 ms after the start (a neighbour starting at the same instant would make
    the first request a tie)."""
    return tuple(replace(INTERACTIVE, phase_ms=5 + i * REQUEST_MS // count)
                 for i in range(count))


ROWS: tuple[Row, ...] = (
    Row("alone", interactive(1)),
    Row("one busy", interactive(1), (BUSY,)),
    Row("four busy", interactive(1), (BUSY,) * 4),
    Row("64 streams x 2 of 20 ms", interactive(1),
        (Workload("q", 20000, depth=2, streams=64),)),
    Row("8 procs each, one busy",
        (replace(INTERACTIVE, procs=8, request_ms=8 * REQUEST_MS, phase_ms=5),),
        (replace(BUSY, procs=8),)),
    Row("single 50 ms kernels", interactive(1), (Workload("long", 50000, depth=1),)),
    Row("2 interactive", interactive(2)),
    Row("4 interactive", interactive(4)),
    Row("8 interactive", interactive(8)),
)


def percentile(values: Sequence[int], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank; nan when there are none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


@dataclass(frozen=True)
class Result:
    """One row under one scheduler: latencies in ms, shares as parts of the GPU's time."""

    p50: float
    p99: float
    max: float
    requests: int
    interactive_share: float
    neighbour_share: float


def result(row: Row, reports: dict[str, Report], seconds: float) -> Result:
    """Latencies of every interactive request of the row, and what each side completed."""
    named = row.workloads()
    latency = [us for w in named if w.request_ms for us in reports[w.name].latency_us]
    share = {w.name: busy_fraction(reports[w.name].kernels, w.us, seconds) for w in named}
    ms = [us / 1000 for us in latency]
    return Result(p50=percentile(latency, 0.5) / 1000, p99=percentile(latency, 0.99) / 1000,
                  max=max(ms, default=math.nan), requests=len(latency),
                  interactive_share=sum(share[w.name] for w in named if w.request_ms),
                  neighbour_share=sum(share[w.name] for w in named if not w.request_ms))


def ratio(value: float, base: float) -> float:
    return value / base if base > 0 else math.nan


HEAD = (f"{'row':<24} {'sched':<8} | {'p50 ms':>6} {'p99 ms':>6} {'max ms':>6} | "
        f"{'p50 x':>5} {'p99 x':>5} {'max x':>5} | {'reqs':>4} {'int':>6} {'nbrs':>6}")


def line(row: Row, column: str, got: Result, base: Result) -> str:
    text = (f"{row.name:<24} {column:<8} | {got.p50:>6.2f} {got.p99:>6.2f} {got.max:>6.2f} | "
            f"{ratio(got.p50, base.p50):>5.2f} {ratio(got.p99, base.p99):>5.2f} "
            f"{ratio(got.max, base.max):>5.2f} | {got.requests:>4} "
            f"{100 * got.interactive_share:>5.1f}% {100 * got.neighbour_share:>5.1f}%")
    if column != "none":
        text += " ok" if ratio(got.p99, base.p99) <= P99_TARGET else " MISSED"
    return text
