"""The in-flight bound on simgpu with its default launch queue (1024 per stream):
a process keeps at most about `max_inflight` launches, and about 4 ms of
work, queued per stream, on every kind of stream, so a closed gate takes
effect within a few kernels."""

from __future__ import annotations

import subprocess
import time

import pytest

from cgpu_km.dataplane import region as region_mod
from tests.libcgpu.sandbox import UUID, Sandbox

KERNEL_MS = 5
BOUND = region_mod.DEFAULT_MAX_INFLIGHT


def queue(sandbox: Sandbox, count: int, where: str = "null", *ops: str, managed: bool = True,
          **env: str) -> dict[str, float]:
    """Run `workload [OPS] queue COUNT sleep_<5 ms> WHERE`; its issue and sync milliseconds."""
    args = [str(sandbox.built.workload), *ops, "queue", str(count), f"sleep_{KERNEL_MS * 1000}",
            where]
    result = subprocess.run(args, env=sandbox.env(preload=managed, region=managed, **env),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(rc == 0 for _, rc in sandbox.rcs(result.stdout)), result.stdout
    line = result.stdout.splitlines()[-1]
    fields = dict(item.split("=") for item in line.split()[3:])
    return {key: float(value) for key, value in fields.items()}


@pytest.mark.parametrize("where", ["null", "ptsz", "perthread", "stream", "launchex", "graph"])
def test_queue_is_bounded_on_every_stream_kind(sandbox: Sandbox, where: str) -> None:
    sandbox.make_region(0)
    got = queue(sandbox, 40, where)
    # what is still queued when the loop ends drains in the sync: 5 ms kernels are long,
    # so about 4 ms of them (two launches at least), not BOUND
    assert got["sync_ms"] < 4 * KERNEL_MS, got
    assert got["issue_ms"] > (40 - 4) * KERNEL_MS, got


def test_zero_means_unbounded_and_env_overrides(sandbox: Sandbox) -> None:
    region = sandbox.make_region(0)
    assert region.gpu_spec(0).max_inflight == BOUND
    unbounded = queue(sandbox, 40, CGPU_MAX_INFLIGHT="0")
    assert unbounded["issue_ms"] < 50, unbounded
    assert unbounded["sync_ms"] > 150, unbounded
    tight = queue(sandbox, 40, CGPU_MAX_INFLIGHT="4")
    assert tight["sync_ms"] < 6 * KERNEL_MS, tight
    region_mod.Region.create(sandbox.region_path, "ctr-test",
                             [region_mod.GpuSpec(0, UUID, 0, 0, max_inflight=0)],
                             gates_open=True).close()
    live = queue(sandbox, 40)
    assert live["sync_ms"] > 150, live
    with pytest.raises(region_mod.RegionError, match="max_inflight must be"):
        region_mod.Region.create(sandbox.region_path, "ctr-test",
                                 [region_mod.GpuSpec(0, UUID, 0, 0, max_inflight=-1)])


def test_streams_and_contexts_come_and_go(sandbox: Sandbox) -> None:
    sandbox.make_region(0)
    # 700 streams (more than libcgpu's table holds at once) and 70 contexts destroyed
    got = queue(sandbox, 40, "stream", "churn", "700")
    assert got["sync_ms"] < (BOUND + 4) * KERNEL_MS, got


def test_waiting_for_the_gpu_counts_as_pending(sandbox: Sandbox) -> None:
    region = sandbox.make_region(0)
    proc = sandbox.popen([str(sandbox.built.workload), "queue", "200",
                          f"sleep_{KERNEL_MS * 1000}", "null"])
    try:
        seen = 0
        deadline = time.monotonic() + 0.8
        while time.monotonic() < deadline:
            seen = max(seen, region.activity(0).pending)
            time.sleep(0.01)
        assert seen >= 1, "a launch waiting for the GPU should count as pending"
    finally:
        proc.communicate(timeout=30)
    assert proc.returncode == 0


@pytest.mark.parametrize("bound", [BOUND, 0], ids=["bounded", "unbounded"])
def test_closed_gate_drains_within_a_few_kernels(sandbox: Sandbox, bound: int) -> None:
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
        time.sleep(0.3)
        closed = time.monotonic_ns()
        region.set_gate(0, False)
        seq = region.close_seq(0)
        deadline = time.monotonic() + 10
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
    if bound:
        assert drained_ms < (bound + 4) * KERNEL_MS, drained_ms
    else:
        assert drained_ms > 300, drained_ms  # about 90 kernels were still queued
