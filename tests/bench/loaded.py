"""The loaded-host part of `make bench`: shares and latency beside CPU-bound processes.

Before each row it starts 2 or 4 plain busy loops per core (`os.cpu_count()`),
each a Python process at nice 0, and stops them after the row, whatever
happens (each loop also ends by itself once the bench is gone). Then:

- shares: policy 2, weights 1:2, one process per container; the steady
  part's ratio within 5% of 2, and the GPU kept at least 85% busy by the
  two containers' completed kernels;
- latency: rows of `latency.ROWS`, each under no scheduler (policy 5) and
  policies 1, 2 and 4 under the same load, side by side; the interactive
  p99 at most 1.5x no scheduler's.

The same rows run on the idle host first, for reference (not with
`--quick`). Figures are printed, never asserted.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Protocol

from tests.bench import latency
from tests.bench.shares import STEADY_AFTER, Report, Summary, Workload, busy_fraction

SHARE_TARGET = 0.05  # |error| of the steady 1:2 ratio
BUSY_TARGET = 0.85  # the GPU's time filled by both containers' kernels, steady part
LOADS = (0, 2, 4)  # busy loops per core; 0: the idle host, for reference
QUICK_LOADS = (2, 4)
KERNELS_US = (50, 1000, 5000, 20000)
QUICK_KERNELS_US = (1000, 5000)
LATENCY_ROWS = ("one busy", "four busy", "8 procs each, one busy", "4 interactive")
QUICK_LATENCY_ROWS = ("one busy", "four busy")

# A busy loop that checks, every few milliseconds, that its parent (the bench, whose
# pid it is given: one that started after the bench died ends at once) is still there:
# killed or not, the bench leaves none behind.
LOOP = """\
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(100_000):
        pass
"""


class Engine(Protocol):
    """What runs the rows: `tests.bench.__main__.Engine` on one simulated host."""

    seconds: float

    def run(self, policy: int, workloads: Sequence[Workload], max_inst: int = 16,
            seconds: float | None = None) -> dict[str, Report]: ...

    def pair(self, policy: int, us: int, procs: int, weights: tuple[int, int],
             target: float) -> Summary: ...

    def lateness(self) -> tuple[int, float, float]: ...


def late_text(before: tuple[int, float, float], after: tuple[int, float, float]) -> str:
    """How late the dispatcher woke for its deadlines between two readings: mean, and
    the most over the whole run so far (ms)."""
    wakes, seconds = after[0] - before[0], after[1] - before[1]
    mean = 1e3 * seconds / wakes if wakes else 0.0
    return f"{mean:5.2f} {1e3 * after[2]:6.1f}"


def cores() -> int:
    return os.cpu_count() or 1


@contextlib.contextmanager
def cpu_load(per_core: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`per_core` busy loops per core at nice 0 while the block runs; all killed after."""
    loops: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(per_core * cores()):
            loop = subprocess.Popen([sys.executable, "-c", LOOP, str(os.getpid())],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    start_new_session=True)
            loops.append(loop)
            with contextlib.suppress(OSError):  # nice 0 needs root where the bench is niced
                os.setpriority(os.PRIO_PROCESS, loop.pid, 0)
        yield loops
    finally:
        for loop in loops:
            loop.kill()
        for loop in loops:
            loop.wait()


def load_label(per_core: int) -> str:
    return "idle host" if per_core == 0 else f"{per_core}/core ({per_core * cores()} loops)"


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def label(us: int) -> str:
    return f"{us / 1000:g} ms" if us >= 1000 else f"{us} us"


def share_rows(engine: Engine, kernels: Sequence[int], loads: Sequence[int]) -> None:
    print(f"Loaded host, shares: policy 2, weights 1:2 (target ratio 2), 1 process each, "
          f"{engine.seconds:g} s, steady from {STEADY_AFTER:g} s; busy loops at nice 0 on "
          f"{cores()} cores. Targets: steady within {100 * SHARE_TARGET:g}%, GPU at least "
          f"{100 * BUSY_TARGET:g}% busy")
    head = (f"{'load':<20} {'kernel':>8} | {'ctr1 k/s':>9} {'ctr2 k/s':>9} | {'whole':>7} "
            f"{'steady':>7} | {'GPU busy':>8} | late ms: mean, most so far")
    print(head)
    print("-" * len(head))
    worst_error, least_busy = 0.0, 1.0
    for per_core in loads:
        for us in kernels:
            before = engine.lateness()
            with cpu_load(per_core):
                s = engine.pair(2, us, 1, (1, 2), 2.0)
            late = late_text(before, engine.lateness())
            busy = busy_fraction(sum(s.steady), us, s.seconds - STEADY_AFTER)
            r1, r2 = s.rates()
            ok = abs(s.steady_error) <= SHARE_TARGET and busy >= BUSY_TARGET
            if per_core:
                worst_error = max(worst_error, abs(s.steady_error))
                least_busy = min(least_busy, busy)
            print(f"{load_label(per_core):<20} {label(us):>8} | {r1:>9.0f} {r2:>9.0f} | "
                  f"{100 * s.whole_error:>+6.2f}% {100 * s.steady_error:>+6.2f}% | "
                  f"{100 * busy:>7.1f}% {verdict(ok):<6} | {late}", flush=True)
    print(f"loaded: worst steady error {100 * worst_error:.2f}% (target: within "
          f"{100 * SHARE_TARGET:g}%) {verdict(worst_error <= SHARE_TARGET)}; least GPU busy "
          f"{100 * least_busy:.1f}% (target: at least {100 * BUSY_TARGET:g}%) "
          f"{verdict(least_busy >= BUSY_TARGET)}\n")


def latency_rows(engine: Engine, names: Sequence[str], loads: Sequence[int]) -> None:
    rows = [row for row in latency.ROWS if row.name in names]
    print(f"Loaded host, latency: {latency.ABOUT}; {engine.seconds:g} s per case; each row "
          f"under none (policy 5) and policies 1, 2, 4 beside the same busy loops; "
          f"{latency.LEGEND}")
    for per_core in loads:
        print(f"\n{load_label(per_core)}:")
        print(latency.HEAD)
        print("-" * len(latency.HEAD))
        worst = 0.0
        before = engine.lateness()
        for row in rows:
            with cpu_load(per_core):
                got = {column: latency.result(row, engine.run(policy, row.workloads()),
                                              engine.seconds)
                       for column, policy in latency.COLUMNS}
            for column, _policy in latency.COLUMNS:
                print(latency.line(row, column, got[column], got["none"]), flush=True)
                if column != "none":
                    worst = max(worst, latency.ratio(got[column].p99, got["none"].p99))
        print(f"{load_label(per_core)}: worst p99 against none under policies 1, 2, 4: "
              f"{worst:.2f}x (target: at most {latency.P99_TARGET:g}x) "
              f"{verdict(worst <= latency.P99_TARGET)}; the dispatcher woke for its "
              f"deadlines late by (ms, mean, most so far) {late_text(before, engine.lateness())}")
    print()
