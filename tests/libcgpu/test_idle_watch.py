"""libcgpu's idle watch on simgpu: while the daemon asks (the region's
idle_grace_ns, with the gate open), a process says itself when it goes idle,
in its slot's idle_ns as soon as its watcher finds it, and rings once the
grace has passed since; the dispatcher never looks at a busy holder."""

from __future__ import annotations

import time

from cgpu_km.dataplane import region as region_mod
from tests.libcgpu.sandbox import Sandbox
from tests.libcgpu.test_gate import go

GRACE_NS = 2_000_000
KERNEL_US = 200_000


def idle_report(region: region_mod.Region, rung: int) -> tuple[int, int]:
    """Wait for a ring after `rung` with an idle report in a live slot; the
    report and the doorbell then."""
    deadline = time.monotonic() + 30  # a hang guard only
    while True:
        bell = region.doorbell(0)
        reports = [region.slot_gpu(slot, 0).idle_ns for slot in region.live_slots()]
        if bell != rung and any(reports):
            return max(reports), bell
        assert time.monotonic() < deadline, f"no idle report (doorbell {bell}, {reports})"
        time.sleep(0.005)


def test_a_process_says_when_its_work_is_done_and_it_launched_nothing(sandbox: Sandbox) -> None:
    """A process that launched a 200 ms kernel and then waits on its stdin: idle
    from when the kernel finished (not from its launch), said once the grace
    has passed, with a ring. Its next launch takes the report back; it says so
    again once idle again, later."""
    region = sandbox.make_region(0)
    region.set_idle_grace(0, GRACE_NS)
    started = time.monotonic_ns()
    proc = sandbox.popen([str(sandbox.built.workload), "launch", "1", f"sleep_{KERNEL_US}",
                          "wait", "launch", "1", "sleep_0", "wait"])
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "launch 1 rc=0\n"
        assert proc.stdout.readline() == "waiting\n"
        first, rung = idle_report(region, 0)
        assert first >= started + KERNEL_US * 1000, "idle only once its kernel had run"
        go(proc)
        assert proc.stdout.readline() == "launch 1 rc=0\n"
        assert proc.stdout.readline() == "waiting\n"
        second, _ = idle_report(region, rung)
        assert second > first, "launched again: busy, then idle again later"
        go(proc)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.communicate()


def test_the_report_stands_at_once_and_is_rung_a_grace_after_its_time(
        sandbox: Sandbox) -> None:
    """With a grace of 2 s: the report is in the slot before the doorbell rings
    (a step for another reason reads it then), and the ring comes no sooner
    than a grace after the time the report names."""
    grace_ns = 2_000_000_000
    region = sandbox.make_region(0)
    region.set_idle_grace(0, grace_ns)
    proc = sandbox.popen([str(sandbox.built.workload), "launch", "1", "sleep_0", "wait"])
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "launch 1 rc=0\n"
        assert proc.stdout.readline() == "waiting\n"
        deadline = time.monotonic() + 30  # a hang guard only
        while not (reports := [region.slot_gpu(slot, 0).idle_ns
                               for slot in region.live_slots()]) or not any(reports):
            assert time.monotonic() < deadline, "no idle report"
            time.sleep(0.005)
        assert region.doorbell(0) == 0, "said before it rang"
        said, _ = idle_report(region, 0)
        assert time.monotonic_ns() >= said + grace_ns, "rung a grace after the report's time"
        go(proc)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.communicate()


def test_nobody_asks_nothing_is_said(sandbox: Sandbox) -> None:
    """Without the daemon's ask (idle_grace_ns 0) an idle process reports
    nothing, however long it stays idle (here ten graces and more)."""
    region = sandbox.make_region(0)
    proc = sandbox.popen([str(sandbox.built.workload), "launch", "1", "sleep_20000", "sync",
                          "wait"])
    try:
        assert proc.stdout is not None
        while proc.stdout.readline() != "waiting\n":
            assert proc.poll() is None, "the workload ended early"
        time.sleep(10 * GRACE_NS / 1e9)
        lines = [region.slot_gpu(slot, 0) for slot in region.live_slots()]
        assert [line.watching for line in lines] == [1], "its one process launched"
        assert [line.idle_ns for line in lines] == [0]
        assert region.doorbell(0) == 0, "and rang for nothing"
        go(proc)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.communicate()
