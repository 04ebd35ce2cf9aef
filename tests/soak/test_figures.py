"""The soak's figures: growth fits, steady windows, recovery, stalls, error lines."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tests.bench.shares import Report
from tests.soak import figures


def report(t0: float, rates: list[int], seconds: float) -> Report:
    """A workload that completes rates[k] kernels in each 10 ms bucket of second k."""
    buckets = tuple(rates[int(k * 0.01)] for k in range(round(seconds / 0.01)))
    return Report(t0=t0, bucket=0.01, buckets=buckets, per_proc=(sum(buckets),))


def test_the_slope_is_fitted_within_segments_with_their_own_intercepts() -> None:
    # Two daemons: each grows 2 per second from its own start value.
    points = [(t, 100 + 2 * t, 0) for t in range(10)]
    points += [(t, 2 * (t - 10), 1) for t in range(10, 20)]
    assert figures.fit_slope(points) == pytest.approx(2.0)
    assert figures.fit_slope([(1, 5, 0)]) is None


def test_a_life_that_warms_up_to_the_same_peak_shows_no_rise_across_lives() -> None:
    # Three daemons, each warming up from 40 to 48 (a fit within lives says +2 a second).
    points = [(t, 40 + 2 * (t % 10 if t % 10 < 4 else 4), t // 10) for t in range(30)]
    assert (figures.fit_slope(points) or 0.0) > 0
    found = figures.peaks(points)
    assert found == [(4, 48), (14, 48), (24, 48)]
    assert figures.fit_slope([(t, y, 0) for t, y in found]) == pytest.approx(0.0)
    assert figures.peaks([]) == []


def test_segments_start_at_restarts_and_leave_out_their_warmup() -> None:
    assert figures.segments([1, 11, 21, 26, 40], [20], warmup=5) == [None, 0, None, 1, 1]


def test_steady_windows_are_the_quiet_busy_spans_long_enough_to_judge() -> None:
    t0 = 1000.0
    first = report(t0, [1] * 12, 12)
    second = report(t0, [2, 2, 2, 2, 3, 2, 2, 0, 2, 2, 2, 2], 12)

    def quiet(start: float, end: float) -> bool:
        return not (start < 6 and end > 5)  # a fault at 5..6 s

    windows = figures.steady_windows(first, second, 0, t0, (0, 12), 2.0, quiet,
                                     lambda _t: 2.0, step=1.0)
    # 0..5 s (4..5 s too fast), not 5..6 s (the fault), 6..7 s (too short), 7..8 s
    # (idle); 8..12 s.
    assert [(w.start, w.seconds) for w in windows] == [(0, 5), (8, 4)]
    assert windows[0].error == pytest.approx(11 / 10 - 1)
    assert not windows[0].held
    assert windows[1].held
    # A change of the policy's ratio ends a window.
    windows = figures.steady_windows(first, second, 0, t0, (8, 12), 2.0, quiet,
                                     lambda t: 2.0 if t < 10 else 1.0, step=1.0)
    assert [(w.start, w.seconds, w.expected) for w in windows] == [(8, 2, 2.0), (10, 2, 1.0)]


def test_pooled_sums_each_gpu_s_windows_of_one_ratio() -> None:
    windows = [figures.Window(0, 0, 4, 2.0, 0.1, (100, 220)),
               figures.Window(0, 8, 4, 2.0, -0.1, (100, 180)),
               figures.Window(0, 20, 4, 1.0, 0.0, (50, 50)),
               figures.Window(1, 0, 4, 2.0, 0.5, (10, 30))]
    assert figures.pooled(windows) == {(0, 2.0): 0.0, (0, 1.0): 0.0, (1, 2.0): 0.5}
    assert figures.pooled(windows, shortest=8) == {(0, 2.0): 0.0}


def test_recovery_is_the_first_time_shares_hold_for_the_next_two_seconds() -> None:
    t0 = 50.0
    first = report(t0, [1] * 12, 12)
    second = report(t0, [2, 2, 1, 1, 0, 2, 2, 2, 2, 2, 2, 2], 12)
    assert figures.recovery(first, second, t0, 2.0, 12.0, lambda _t: 2.0) == 3.0
    assert figures.recovery(first, second, t0, 2.0, 6.5, lambda _t: 2.0) is None
    assert figures.stall(first, second, t0, 2.0) == 1.0


def test_ratio_error_of_nothing_is_infinite() -> None:
    assert math.isinf(figures.ratio_error(0, 5, 1.0))


def test_log_lines_get_the_time_the_log_first_held_them() -> None:
    text = "a\nbb\nccc\n"
    assert figures.timed_lines(text, [(1.0, 2), (2.0, 5), (3.0, 9)]) == [
        (1.0, "a"), (2.0, "bb"), (3.0, "ccc")]


def test_error_lines_are_explained_only_by_a_fault_of_their_kind_soon_before() -> None:
    lines = [(10.0, "cgpu-daemon: ERROR: tree read failed"),
             (12.0, "cgpu-daemon: INFO: fine"),
             (50.0, "cgpu-daemon: ERROR: tree read failed"),
             (11.0, "cgpu-daemon: ERROR: something else")]
    faults = [("fuse-kill", 9.5), ("daemon-kill", 45.0)]
    assert figures.unexplained_errors(lines, faults) == [lines[2], lines[3]]


def test_mean_lateness_is_the_counters_growth_across_the_span_of_one_daemon() -> None:
    samples = [(1.0, 7, 100, 0.1), (2.0, 7, 150, 0.2), (3.0, 7, 250, 0.5), (4.0, 9, 10, 0.0)]
    assert figures.mean_lateness(samples, 1.5, 2.5) == pytest.approx(1e3 * 0.4 / 150)
    assert figures.mean_lateness(samples, 2.0, 3.0) == pytest.approx(1e3 * 0.3 / 100)
    assert figures.mean_lateness(samples, 2.5, 3.5) is None  # a restart in between
    assert figures.mean_lateness(samples, 0.5, 2.0) is None  # nothing before the start


def test_audits_count_the_gpus_own_lines_near_the_window() -> None:
    line = "cgpu-daemon: INFO: container {} on GPU {}: audited for 0.42 s (its samples rose)"
    lines = [(10.0, line.format("c1", 3)), (10.0, line.format("c2", 4)),
             (20.0, line.format("c3", 3)), (12.0, "cgpu-daemon: INFO: GPU 3: audited for")]
    assert figures.audits(lines, 3, 11.0, 15.0) == 1
    assert figures.audits(lines, 3, 5.0, 25.0) == 2
    assert figures.audits(lines, 4, 5.0, 25.0) == 1
    assert figures.audits(lines, 5, 5.0, 25.0) == 0


def test_a_window_with_an_audit_or_too_little_gpu_time_is_shown_not_judged() -> None:
    window = figures.Window(0, 10.0, 4.0, 2.0, 0.09, (300, 654), kernel=0.005)
    assert window.unjudged == ""
    assert "audit" in replace(window, audits=1).unjudged
    assert "under 1 s" in replace(window, kernels=(199, 430)).unjudged
    assert replace(window, kernels=(199, 430), kernel=0.0).unjudged == ""  # not known
    # pooled leaves the audited window out
    audited = replace(window, start=20.0, kernels=(100, 100), audits=1)
    assert figures.pooled([window, audited]) == {(0, 2.0): pytest.approx(654 / 300 / 2 - 1)}
