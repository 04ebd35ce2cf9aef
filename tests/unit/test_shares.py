"""The share arithmetic of `tests.bench.shares`, without processes."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.bench.shares import (
    STEADY_AFTER,
    Report,
    busy_fraction,
    count,
    parse_report,
    ratio_error,
    resolving_seconds,
    summarize,
    window_counts,
    window_starts,
)

OUTPUT = """ready pid=41 procs=2
counts t0=100.250000000 bucket_ms=10 seconds=0.05 procs=2 kernels=9 per_proc=4,5
buckets 1 2 3 0 3 0
"""

buckets_st = st.lists(st.integers(0, 50), min_size=1, max_size=300).map(tuple)


def report(buckets: tuple[int, ...], t0: float = 100.0) -> Report:
    return Report(t0=t0, bucket=0.01, buckets=buckets, per_proc=(sum(buckets),))


def test_parse_report_reads_sharework_output() -> None:
    got = parse_report(OUTPUT)
    assert got == Report(t0=100.25, bucket=0.01, buckets=(1, 2, 3, 0, 3, 0), per_proc=(4, 5))
    assert got.kernels == 9


@pytest.mark.parametrize("text", [
    "ready pid=1 procs=1\n",  # the workload died before its counts
    OUTPUT.replace("kernels=9", "kernels=8"),
    OUTPUT.replace("per_proc=4,5", "per_proc=4,4"),
])
def test_parse_report_refuses_missing_or_inconsistent_counts(text: str) -> None:
    with pytest.raises(ValueError, match="counts"):
        parse_report(text)


def test_count_takes_the_buckets_that_start_in_the_interval() -> None:
    r = report((1, 2, 3, 4))
    assert count(r, 100.0, 100.04) == 10
    assert count(r, 100.01, 100.03) == 5
    assert count(r, 100.005, 100.025) == 5  # buckets starting at .01 and .02
    assert count(r, 99.0, 100.0) == 0
    assert count(r, 100.04, 101.0) == 0


@given(buckets_st, st.lists(st.floats(-1.0, 4.0), min_size=3, max_size=3))
def test_count_is_additive_and_covers_everything(buckets: tuple[int, ...],
                                                  offsets: list[float]) -> None:
    r = report(buckets)
    a, b, c = sorted(100.0 + x for x in offsets)
    assert count(r, a, b) + count(r, b, c) == count(r, a, c)
    assert count(r, 100.0, 100.0 + len(buckets) * 0.01) == sum(buckets)


def test_window_starts_slide_by_step_and_fit() -> None:
    starts = window_starts(0.5, 3.0, width=1.0, step=0.1)
    assert len(starts) == 16
    assert starts[0] == 0.5
    assert starts[-1] == pytest.approx(2.0)
    assert window_starts(0.0, 0.9, width=1.0, step=0.1) == []


@given(st.floats(0.0, 5.0), st.floats(0.0, 10.0), st.sampled_from([0.1, 0.25, 0.5]))
def test_every_window_fits_in_the_interval(start: float, length: float, step: float) -> None:
    starts = window_starts(start, start + length, 1.0, step)
    assert all(s + 1.0 <= start + length + 1e-6 for s in starts)
    # and one more step would not fit
    last = starts[-1] if starts else start - step
    assert last + step + 1.0 > start + length - 1e-6


@given(buckets_st, buckets_st)
def test_window_counts_are_each_reports_count_in_the_window(first: tuple[int, ...],
                                                            second: tuple[int, ...]) -> None:
    a, b = report(first), report(second)
    windows = window_counts([a, b], 100.5, 103.0)
    assert len(windows) == 16
    assert windows[3] == (count(a, 100.8, 101.8), count(b, 100.8, 101.8))


def test_ratio_error_against_the_target() -> None:
    assert ratio_error(100, 200, 2.0) == 0.0
    assert ratio_error(100, 190, 2.0) == pytest.approx(-0.05)
    assert ratio_error(100, 210, 2.0) == pytest.approx(0.05)
    assert ratio_error(0, 5, 2.0) == math.inf


@given(st.integers(1, 10_000), st.integers(1, 5))
def test_exact_shares_have_no_error(first: int, factor: int) -> None:
    assert ratio_error(first, first * factor, float(factor)) == pytest.approx(0.0)


def test_runs_of_long_kernels_are_long_enough_to_resolve_the_target() -> None:
    """At a third of the GPU, 8 processes of 20 ms kernels end 16.7 kernels a
    second in bursts of 8: 7 s of steady part hold 117, where a burst at each
    end is 14%; a 2% error needs 800 of them, 48 s."""
    assert resolving_seconds(20_000, 8, 1 / 3, 0.02, 8.0) == pytest.approx(49.0)
    assert resolving_seconds(20_000, 4, 1 / 3, 0.02, 8.0) == pytest.approx(25.0)
    assert resolving_seconds(50, 8, 1 / 3, 0.02, 8.0) == 8.0


@given(st.sampled_from((50, 1000, 5000, 20_000)), st.integers(1, 64),
       st.sampled_from((1 / 3, 1 / 2, 2 / 3)), st.floats(0.005, 0.1))
def test_a_burst_at_each_end_is_within_the_error(us: int, procs: int, share: float,
                                                 error: float) -> None:
    seconds = resolving_seconds(us, procs, share, error, 1.0)
    kernels = (seconds - STEADY_AFTER) * share / (us / 1e6)
    assert 2 * procs / kernels <= error * (1 + 1e-9)


def test_busy_fraction_is_kernel_time_over_wall_time() -> None:
    assert busy_fraction(1000, 1000, 4.0) == 0.25
    assert busy_fraction(0, 1000, 1.0) == 0.0


def test_summarize_splits_whole_steady_and_windows() -> None:
    # 3 s; the first container completes 1 kernel per bucket, the second 2, except
    # that for the first 0.5 s they complete the same (a scheduler's slow start).
    first = report((1,) * 300)
    second = report((1,) * 50 + (2,) * 250)
    s = summarize(first, second, 3.0, target=2.0)
    assert s.whole == (300, 550)
    assert s.steady == (200, 400)
    assert s.steady_error == 0.0
    assert s.whole_error == pytest.approx(550 / 300 / 2 - 1)
    assert len(s.windows) == 16
    assert s.worst_window_error == 0.0  # windows start at 0.5 s
    assert s.rates() == pytest.approx((100.0, 550 / 3))


def test_worst_window_keeps_its_sign() -> None:
    first = report((1,) * 300)
    second = report((2,) * 150 + (1,) * 10 + (2,) * 140)
    s = summarize(first, second, 3.0, target=2.0)
    assert s.worst_window_error == pytest.approx(-0.05)
    # that window: 100 of 290 kernels against a third
    assert s.worst_window_points == pytest.approx(100 * 100 / 290 - 100 / 3)
