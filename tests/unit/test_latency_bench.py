"""The latency bench's arithmetic (`tests.bench.latency`), without processes."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from tests.bench.latency import ROWS, Row, percentile, result
from tests.bench.shares import Report, Workload, parse_report

OUTPUT = """ready pid=7 procs=1
counts t0=5.000000000 bucket_ms=10 seconds=0.03 procs=1 kernels=4 per_proc=4
buckets 2 0 2 0
latency_us 2100 2500
"""


def test_latencies_are_parsed_with_the_counts() -> None:
    assert parse_report(OUTPUT).latency_us == (2100, 2500)


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=500),
       st.floats(0.0, 1.0))
def test_percentile_is_a_value_with_the_rank_asked_for(values: list[int], q: float) -> None:
    got = percentile(values, q)
    assert got in values
    assert sum(v <= got for v in values) >= q * len(values)
    assert sum(v < got for v in values) < max(q * len(values), 1)


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile([], 0.5))


def test_a_row_result_splits_shares_by_side() -> None:
    row = Row("one busy", (Workload("i", 1000, depth=2, request_ms=20),),
              (Workload("b", 1000, depth=4),))
    names = [w.name for w in row.workloads()]
    assert names == ["int0", "nb0"]
    reports = {
        "int0": Report(t0=0.0, bucket=0.01, buckets=(2, 2), per_proc=(4,),
                       latency_us=(2000, 3000)),
        "nb0": Report(t0=0.0, bucket=0.01, buckets=(500, 400), per_proc=(900,)),
    }
    got = result(row, reports, 1.0)
    assert (got.p50, got.p99, got.max, got.requests) == (2.0, 3.0, 3.0, 2)
    assert got.interactive_share == 0.004
    assert got.neighbour_share == 0.9


def test_every_row_has_a_serving_container() -> None:
    assert all(any(w.request_ms for w in row.workloads()) for row in ROWS)
