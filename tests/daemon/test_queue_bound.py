"""A neighbour's queue delays a request by at most one of its kernels, under every policy.

The real daemon and `cgpu-run` containers on simgpu's fifo engine, where a
kernel runs only once everything booked before it has run (no time slicing
between processes hides a queue): what a request waits behind is what its
neighbour had queued when the request's first kernel reached the driver.
libcgpu holds each process's GPU time queued ahead of its newest launch,
over all its streams, to a budget, so a neighbour with 64 streams of 20 ms
kernels 2 deep (128 launches, 2.5 s, without the budget) keeps one running
and one waiting. Counted on simgpu's own record of every kernel it booked
(SIMGPU_KERNEL_TRACE), never on a clock: for each request, the neighbour's
kernels booked before its first one that had not started when it was
launched. The wait at the gate before that launch is the scheduler's, tested
in tests/sched/test_wakeups.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bench.shares import Workload, measure
from tests.daemon.simbox import SimHost, missing
from tests.simgpu.kernel_trace import Kernel, parse_trace, waiting_at_launch

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

REQUEST_US = 1000
SECONDS = 2.0
NEIGHBOURS = {
    "64 streams x 2 of 20 ms": Workload("nb", 20000, weight=1, depth=2, streams=64),
    "single 50 ms": Workload("nb", 50000, weight=1, depth=1),
}


def queued_ahead(kernels: list[Kernel], depth: int) -> list[int]:
    """For each request (`depth` kernels of REQUEST_US in a row), how many kernels
    booked before its first one had not started at its launch (its own earlier
    requests had ended: those are the neighbour's)."""
    firsts = [i for i, kernel in enumerate(kernels) if kernel.us == REQUEST_US][::depth]
    return [waiting_at_launch(kernels, i) for i in firsts]


def test_the_trace_parser_counts_what_was_queued_ahead() -> None:
    trace = "\n".join(f"kernel pid={pid} launch={launch} start={start} end={start + us * 1000}"
                      for pid, launch, start, us in [
                          (7, 0, 0, 20000),                 # running at the request's launch
                          (7, 1000, 20_000_000, 20000),     # queued ahead of it
                          (9, 2000, 40_000_000, 1000),      # the request
                          (9, 2100, 41_000_000, 1000),
                          (7, 3000, 42_000_000, 20000)])    # behind it
    assert queued_ahead(parse_trace(trace), 2) == [1]
    with pytest.raises(ValueError, match="not a kernel line"):
        parse_trace("garbage")


@pytest.fixture
def fifo_host(tmp_path: Path, control_tree: Path) -> Iterator[SimHost]:
    sim = SimHost(tmp_path, control_tree, env={
        "SIMGPU_SCHED": "fifo", "SIMGPU_KERNEL_TRACE": str(tmp_path / "kernels.trace")})
    yield sim
    sim.close()


@pytest.mark.parametrize("policy", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("neighbour", sorted(NEIGHBOURS))
def test_a_request_waits_behind_at_most_one_neighbour_kernel(fifo_host: SimHost, policy: int,
                                                             neighbour: str) -> None:
    fifo_host.echo("0/policy", policy)
    fifo_host.echo("0/max_inst", 2)  # policies 0 and 3: a share of 1/2 each
    fifo_host.start_daemon()
    nb = NEIGHBOURS[neighbour]
    interactive = Workload("int", REQUEST_US, depth=2, request_ms=20, phase_ms=5, weight=1)
    measure(fifo_host, [interactive, nb], SECONDS)
    kernels = parse_trace((fifo_host.tmp / "kernels.trace").read_text())
    # the neighbour kept the GPU busy, and the requests ran beside it
    assert sum(k.us == nb.us for k in kernels) * nb.us >= SECONDS * 1e6 / 4, len(kernels)
    ahead = queued_ahead(kernels, interactive.depth)
    assert len(ahead) >= 20, f"the requests ran: {len(ahead)}"
    assert max(ahead) <= 1, ahead
