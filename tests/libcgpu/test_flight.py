"""The in-flight bound on simgpu with its default launch queue (1024 per stream):
a process keeps at most about `max_inflight` launches, and about 4 ms of
work, queued per stream, on every kind of stream, so a closed gate takes
effect within a few kernels. What is queued is counted (an event behind each
launch, not yet complete as the launch loop ends), never timed; the times
are printed, and `make bench` has them side by side (tests/bench/deadlines.py)."""

from __future__ import annotations

import subprocess
import time

import pytest

from cgpu_km.dataplane import region as region_mod
from tests.daemon.simbox import SHAREWORK
from tests.libcgpu.sandbox import UUID, Sandbox
from tests.simgpu.kernel_trace import parse_trace, waiting_at_launch

KERNEL_MS = 5
BOUND = region_mod.DEFAULT_MAX_INFLIGHT


def queue(sandbox: Sandbox, count: int, where: str = "null", *ops: str, managed: bool = True,
          **env: str) -> dict[str, float]:
    """Run `workload [OPS] queue COUNT sleep_<5 ms> WHERE`; its issue and sync
    milliseconds, and how many launches were queued (not complete) as its loop ended."""
    args = [str(sandbox.built.workload), *ops, "queue", str(count), f"sleep_{KERNEL_MS * 1000}",
            where]
    result = subprocess.run(args, env=sandbox.env(preload=managed, region=managed, **env),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(rc == 0 for _, rc in sandbox.rcs(result.stdout)), result.stdout
    line = result.stdout.splitlines()[-1]
    print(line)
    fields = dict(item.split("=") for item in line.split()[3:])
    return {key: float(value) for key, value in fields.items()}


# With the bound's 4 ms of work, 5 ms kernels leave two launches queued at most (the
# bound keeps at least two); the count bound alone allows BOUND - 1; without a bound,
# 40 launches issue long before the first few kernels end.
FEW = 2
MANY = BOUND


@pytest.mark.parametrize("where", ["null", "ptsz", "perthread", "stream", "launchex", "graph"])
def test_queue_is_bounded_on_every_stream_kind(sandbox: Sandbox, where: str) -> None:
    sandbox.make_region(0)
    got = queue(sandbox, 40, where)
    assert got["queued"] <= FEW, got


def test_zero_means_unbounded_and_env_overrides(sandbox: Sandbox) -> None:
    region = sandbox.make_region(0)
    assert region.gpu_spec(0).max_inflight == BOUND
    unbounded = queue(sandbox, 40, CGPU_MAX_INFLIGHT="0")
    assert unbounded["queued"] >= MANY, unbounded
    tight = queue(sandbox, 40, CGPU_MAX_INFLIGHT="4")
    assert tight["queued"] <= FEW, tight
    region_mod.Region.create(sandbox.region_path, "ctr-test",
                             [region_mod.GpuSpec(0, UUID, 0, 0, max_inflight=0)],
                             gates_open=True).close()
    live = queue(sandbox, 40)
    assert live["queued"] >= MANY, live
    with pytest.raises(region_mod.RegionError, match="max_inflight must be"):
        region_mod.Region.create(sandbox.region_path, "ctr-test",
                                 [region_mod.GpuSpec(0, UUID, 0, 0, max_inflight=-1)])


def test_streams_and_contexts_come_and_go(sandbox: Sandbox) -> None:
    sandbox.make_region(0)
    # 700 streams (more than libcgpu's table holds at once) and 70 contexts destroyed
    got = queue(sandbox, 40, "stream", "churn", "700")
    assert got["queued"] < BOUND, got


def test_waiting_for_the_gpu_counts_as_pending(sandbox: Sandbox) -> None:
    region = sandbox.make_region(0)
    proc = sandbox.popen([str(sandbox.built.workload), "queue", "200",
                          f"sleep_{KERNEL_MS * 1000}", "null"])
    try:
        # 200 launches of 5 ms against a bound of a few: it waits for the GPU for 1 s
        while region.activity(0).pending == 0:
            assert proc.poll() is None, "a launch waiting for the GPU should count as pending"
            time.sleep(0.002)
    finally:
        proc.communicate(timeout=30)
    assert proc.returncode == 0


@pytest.mark.parametrize("bound", [BOUND, 0], ids=["bounded", "unbounded"])
def test_a_closed_gate_drain_is_answered(sandbox: Sandbox, bound: int) -> None:
    """A managed process floods 5 ms kernels; its gate closes; its watcher
    answers once what it had queued has run: a few kernels with the bound."""
    region = region_mod.Region.create(sandbox.region_path, "ctr-test",
                                      [region_mod.GpuSpec(0, UUID, 0, 0, max_inflight=bound)],
                                      gates_open=True)
    sandbox.region = region
    sandbox.start_heartbeat()
    proc = sandbox.popen([str(sandbox.built.workload), "queue", "150",
                          f"sleep_{KERNEL_MS * 1000}", "null"])
    try:
        # the flood under way: more launched than the bound lets be queued
        while region.activity(0).launches < 2 * BOUND:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.002)
        closed = time.monotonic_ns()
        region.set_gate(0, False)
        seq = region.close_seq(0)
        deadline = time.monotonic() + 30  # a hang guard only
        while True:
            # a process that exits first answers nothing: its work ended with it
            if proc.poll() is not None:
                drained_ms = (time.monotonic_ns() - closed) / 1e6
                break
            lines = [region.slot_gpu(slot, 0) for slot in region.live_slots()]
            watching = [line for line in lines if line.watching]
            if watching and all(line.drained_seq == seq for line in watching):
                drained_ms = (max(line.drained_ns for line in watching) - closed) / 1e6
                break
            assert time.monotonic() < deadline, "the watcher never answered the close"
            time.sleep(0.002)
        assert bound == 0 or proc.poll() is None, "the bound held its launches back"
    finally:
        region.set_gate(0, True)
        proc.communicate(timeout=30)
    print(f"max_inflight {bound}: drained {drained_ms:.1f} ms after the close "
          f"({drained_ms / KERNEL_MS:.1f} kernels of {KERNEL_MS} ms)")
    if not bound:
        # more than a bound would have let be queued kept running after the close
        assert drained_ms >= MANY * KERNEL_MS, drained_ms


@pytest.mark.parametrize("barrier", ["membarrier", "fenced"])
def test_a_drain_waits_for_a_launch_still_in_the_driver(sandbox: Sandbox, barrier: str) -> None:
    """Two 300 ms kernels on one stream, with room for one in the driver's queue:
    the second launch waits inside the driver until the first has run. The gate
    closes meanwhile; the answer must wait for the second kernel too (the drain's
    marker goes behind it), whether the drain's barrier is membarrier(2) or, where
    a seccomp profile refuses that, each launch's own fence."""
    kernel_ns = 300_000_000
    region = region_mod.Region.create(sandbox.region_path, "ctr-test",
                                      [region_mod.GpuSpec(0, UUID, 0, 0, max_inflight=0)],
                                      gates_open=True)
    sandbox.region = region
    sandbox.start_heartbeat()
    refuse = ["nomembarrier"] if barrier == "fenced" else []
    proc = sandbox.popen([str(sandbox.built.workload), *refuse, "stamped", "2",
                          f"sleep_{kernel_ns // 1000}", "sleep", "3000"],
                         SIMGPU_QUEUE_DEPTH="1")
    try:
        # the second launch passed the gate (it is counted there): now it is on its way
        while region.activity(0).launches < 2:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.002)
        region.set_gate(0, False)
        seq = region.close_seq(0)
        deadline = time.monotonic() + 30  # a hang guard only
        while True:
            lines = [region.slot_gpu(slot, 0) for slot in region.live_slots()]
            answered = [line.drained_ns for line in lines if line.drained_seq == seq]
            if answered:
                break
            assert proc.poll() is None, "the process ended before it answered the close"
            assert time.monotonic() < deadline, "the watcher never answered the close"
            time.sleep(0.002)
    finally:
        region.set_gate(0, True)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, out + err
    assert ("membarrier refused" in out) == (barrier == "fenced"), out
    returned = [int(line.split()[2]) for line in out.splitlines()
                if line.startswith("returned ")]
    assert len(returned) == 2, out
    # drained behind the second kernel, which runs after its launch returned
    assert answered[0] - returned[1] > kernel_ns // 2, (answered[0] - returned[1], out)


def most_waiting(sandbox: Sandbox, *, managed: bool = True) -> int:
    """`sharework` with 16 streams of 5 ms kernels, 2 deep, on the fifo engine: the most
    kernels that were queued, not yet started, when one of its kernels was launched
    (from simgpu's own record)."""
    trace = sandbox.tmp / "kernels.trace"
    trace.unlink(missing_ok=True)
    result = subprocess.run(
        [str(SHAREWORK), "--us", str(KERNEL_MS * 1000), "--seconds", "0.4", "--depth", "2",
         "--streams", "16"],
        env=sandbox.env(preload=managed, region=managed, SIMGPU_SCHED="fifo",
                        SIMGPU_KERNEL_TRACE=str(trace)),
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    kernels = parse_trace(trace.read_text())
    assert len(kernels) >= 40, len(kernels)
    return max(waiting_at_launch(kernels, i) for i in range(len(kernels)))


def test_queued_gpu_time_is_bounded_over_all_streams(sandbox: Sandbox) -> None:
    """Two launches per stream would leave 30 kernels (150 ms) waiting; the budget (4 ms
    unless the region says) counts what is queued ahead of the newest launch, so a
    5 ms kernel is launched only when the one before it runs; the region's budget is
    what counts, and an unmanaged process has none."""
    region = sandbox.make_region(0)
    assert region.queue_ns(0) == 0
    assert most_waiting(sandbox) <= 1
    region.set_queue_ns(0, 10 * KERNEL_MS * 1_000_000)  # 10 kernels' worth
    # about 10 (the time per launch is measured by host wake-ups: it wanders a little)
    assert 4 <= most_waiting(sandbox) <= 20
    assert most_waiting(sandbox, managed=False) >= 25  # 2 per stream, one running
    with pytest.raises(region_mod.RegionError, match="queue_ns must be"):
        region.set_queue_ns(0, -1)
