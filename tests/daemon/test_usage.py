"""What the compute check reads: NVML's sample times put on the daemon's clock."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from cgpu_km.dataplane.usage import clock_offset

WALL_LEAD = 1_700_000_000.0  # the wall clock's true lead on the monotonic one


def clocks(stalls: list[float]) -> tuple[Callable[[], float], Callable[[], float]]:
    """A monotonic and a wall clock, 1 us per read; before the wall clock's k-th
    read the reading thread is stopped for stalls[k] seconds."""
    now = [100.0]
    pauses: Iterator[float] = iter(stalls)

    def monotonic() -> float:
        now[0] += 1e-6
        return now[0]

    def wall() -> float:
        now[0] += next(pauses, 0.0) + 1e-6
        return now[0] + WALL_LEAD

    return monotonic, wall


def test_a_thread_stopped_between_the_two_clocks_does_not_move_the_samples() -> None:
    """Stopped for 60 ms in the first read (the GIL taken by the dispatcher on a
    starved host): read plainly, every sample of the round would be dated
    60 ms early, past the judge's margin, and weighed against grants of a
    span in which it did not run."""
    monotonic, wall = clocks([0.06])
    assert math.isclose(clock_offset(monotonic, wall), WALL_LEAD, abs_tol=1e-5)
    monotonic, wall = clocks([0.06, 0.03, 0.05, 0.02])  # never a clean read: the least
    assert math.isclose(clock_offset(monotonic, wall), WALL_LEAD, abs_tol=0.011)
    monotonic, wall = clocks([])
    assert math.isclose(clock_offset(monotonic, wall), WALL_LEAD, abs_tol=1e-5)
