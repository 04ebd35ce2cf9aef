"""The compute gate on simgpu: every launch path waits while the gate is closed
and goes on when it opens; a stale heartbeat opens it; launches are counted."""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cgpu_km.dataplane import region as region_mod
from tests.libcgpu.sandbox import HERE, UUID, Sandbox, wait_in_syscall

LAUNCHES = {
    "cuLaunchKernel": ["launch", "1", "sleep_0"],
    "cuLaunchKernelEx": ["launchex", "1", "sleep_0"],
    "cuLaunchCooperativeKernel": ["coop", "1", "sleep_0"],
    "cuGraphLaunch": ["graph", "1"],
}


def start(sandbox: Sandbox, path: str, launch: list[str]) -> subprocess.Popen[str]:
    """A workload that prepares, prints "waiting", and launches after one stdin line."""
    if path == "ctypes":
        args = [sys.executable, str(HERE / "ctypes_workload.py"), "wait", *launch]
    else:
        prep = ["graphprep"] if launch[0] == "graph" else []
        flags = {"exported": [], "getproc": ["--getproc"], "ptsz": ["--getproc-ptsz"]}[path]
        args = [str(sandbox.built.workload), *flags, *prep, "wait", *launch]
    proc = sandbox.popen(args)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    while line.startswith("graphprep"):
        assert line == "graphprep rc=0\n"
        line = proc.stdout.readline()
    assert line == "waiting\n", line + (proc.stderr.read() if proc.stderr else "")
    return proc


# futex(2)'s number, which /proc/<pid>/syscall shows while a thread sleeps in it.
FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())


def wait_parked(proc: subprocess.Popen[str]) -> None:
    """Wait until the launching (main) thread sleeps in futex(2): libcgpu's wait at a
    closed gate is a FUTEX_WAIT on the gate word, so this is the event of the launch
    being held."""
    if FUTEX is None:
        pytest.skip(f"futex(2)'s number on {platform.machine()} is not known here")
    wait_in_syscall(proc.pid, proc.pid, FUTEX, "the launch at a closed gate",
                    running=lambda: proc.poll() is None)


def rechecks(proc: subprocess.Popen[str]) -> int:
    """How often the launching (main) thread has gone to sleep: at a closed gate, once
    per re-check of the heartbeat (libcgpu's FUTEX_WAIT times out at least every 100 ms)."""
    status = Path(f"/proc/{proc.pid}/task/{proc.pid}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


def go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def wait_pending(region: region_mod.Region, want: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while region.activity(0).pending != want:
        assert time.monotonic() < deadline, f"pending never reached {want}"
        time.sleep(0.01)


CASES = [(path, name) for path in ("exported", "getproc", "ptsz") for name in LAUNCHES]
CASES.append(("ctypes", "cuLaunchKernel"))


@pytest.mark.parametrize(("path", "name"), CASES, ids=[f"{p}-{n}" for p, n in CASES])
def test_gate_blocks_and_releases(sandbox: Sandbox, path: str, name: str) -> None:
    region = sandbox.make_region(1 << 30)
    sandbox.start_heartbeat()
    proc = start(sandbox, path, LAUNCHES[name])
    region.set_gate(0, False)
    go(proc)
    wait_pending(region, 1)
    wait_parked(proc)
    assert proc.poll() is None, "the launch went through a closed gate"
    region.set_gate(0, True)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, out + err
    assert out.endswith(" 1 rc=0\n"), out
    activity = region.activity(0)
    assert activity.pending == 0
    assert activity.launches >= 1
    assert activity.gate_wait_ns > 0


def test_open_gate_counts_launches(sandbox: Sandbox) -> None:
    region = sandbox.make_region(1 << 30)
    sandbox.start_heartbeat()
    result = sandbox.workload("launch", "25", "sleep_0", "launchex", "5", "sleep_0")
    assert result.returncode == 0, result.stderr
    activity = region.activity(0)
    assert activity.launches == 30
    assert activity.gate_wait_ns == 0


@pytest.mark.parametrize("heartbeat", ["never", "stale"])
def test_without_a_live_daemon_launches_go_through(sandbox: Sandbox, heartbeat: str) -> None:
    region = sandbox.make_region(1 << 30, gate_timeout_ns=500_000_000)
    if heartbeat == "stale":
        region.heartbeat(time.monotonic_ns() - 5_000_000_000)
    region.set_gate(0, False)
    started = time.monotonic()
    result = sandbox.workload("launch", "3", "sleep_0", timeout=10)
    assert result.stdout == "launch 3 rc=0\n"
    assert region.failed_open(0) is None, "a launch waited at a dead daemon's gate"
    print(f"3 launches through a dead daemon's gate in {time.monotonic() - started:.2f} s")


def test_gate_fails_open_when_the_daemon_stops(sandbox: Sandbox) -> None:
    region = sandbox.make_region(1 << 30, gate_timeout_ns=400_000_000)
    sandbox.start_heartbeat()
    proc = start(sandbox, "exported", LAUNCHES["cuLaunchKernel"])
    region.set_gate(0, False)
    go(proc)
    wait_pending(region, 1)
    wait_parked(proc)
    # Held past the gate timeout by fresh heartbeats: once the heartbeat is stamped later
    # than the timeout after the launch began waiting, the launch re-checks it (a new
    # sleep after a wake-up) and sleeps again instead of going through.
    past_timeout = time.monotonic_ns() + region.gate_timeout_ns
    deadline = time.monotonic() + 30  # a hang guard only
    while region.heartbeat_ns < past_timeout:
        assert time.monotonic() < deadline, "the heartbeat stopped"
        time.sleep(0.01)
    woken = rechecks(proc)
    while rechecks(proc) == woken:
        assert proc.poll() is None, "a fresh heartbeat keeps the gate closed"
        assert time.monotonic() < deadline, "the launch never re-checked the heartbeat"
        time.sleep(0.01)
    wait_parked(proc)
    assert proc.poll() is None, "a fresh heartbeat keeps the gate closed"
    assert region.failed_open(0) is None
    sandbox.stop_heartbeat()
    out, _ = proc.communicate(timeout=10)
    assert out.endswith("launch 1 rc=0\n")
    # What the launch recorded as it went on: the last heartbeat, judged stale once it
    # was the gate timeout old, and a last timed wait that was to end by then (not a
    # poll that overslept the deadline).
    record = region.failed_open(0)
    assert record is not None, "the launch went on without recording it"
    deadline = record.heartbeat_ns + region.gate_timeout_ns
    assert record.heartbeat_ns == region.heartbeat_ns
    assert record.age_ns >= region.gate_timeout_ns, record
    assert 0 < record.wake_ns <= deadline, record
    print(f"the gate failed open {record.age_ns / 1e9:.3f} s after the last heartbeat "
          f"(gate timeout 0.4 s; its last wait was to end {(deadline - record.wake_ns) / 1e6:.1f}"
          " ms before that)")


def test_no_heartbeat_releases_at_a_recheck(sandbox: Sandbox) -> None:
    region = sandbox.make_region(1 << 30, gate_timeout_ns=60_000_000_000)
    region.heartbeat()
    proc = start(sandbox, "exported", LAUNCHES["cuLaunchKernel"])
    region.set_gate(0, False)
    go(proc)
    wait_pending(region, 1)
    released = time.monotonic()
    region.heartbeat(0)  # what a daemon that says it is gone leaves
    out, _ = proc.communicate(timeout=10)
    # Released before communicate's 10 s guard: by the recheck, not the 60 s timeout.
    assert out.endswith("launch 1 rc=0\n")
    record = region.failed_open(0)
    assert record is not None
    assert record.heartbeat_ns == 0, record
    print(f"released {time.monotonic() - released:.2f} s after the heartbeat went to 0")


def test_gates_are_per_gpu(sandbox: Sandbox) -> None:
    second = "GPU-6a3f2c10-84b1-4f0e-9d2a-51c7e0b4a9d4"
    sandbox.base_env["SIMGPU_DEVICES"] += f",Tesla T4:15109MiB:{second}"
    region = region_mod.Region.create(
        sandbox.region_path, "two", [region_mod.GpuSpec(1 << 30, UUID, 0, 0),
                                     region_mod.GpuSpec(1 << 30, second, 1, 0)],
        gates_open=True)
    sandbox.region = region
    sandbox.start_heartbeat()
    region.set_gate(1, False)
    result = sandbox.workload("--device", "0", "launch", "2", "sleep_0", timeout=10)
    assert result.stdout == "launch 2 rc=0\n"
    assert region.activity(0).launches == 2
    proc = sandbox.popen([str(sandbox.built.workload), "--device", "1", "wait",
                          "launch", "1", "sleep_0"])
    assert proc.stdout is not None
    assert proc.stdout.readline() == "waiting\n"
    go(proc)
    deadline = time.monotonic() + 10
    while region.activity(1).pending != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert region.activity(0).pending == 0
    region.set_gate(1, True)
    out, _ = proc.communicate(timeout=10)
    assert out.endswith("launch 1 rc=0\n")
    assert region.activity(1).launches == 1


def test_an_armed_gate_lets_launches_through_and_rings_once_per_arming(
        sandbox: Sandbox) -> None:
    region = sandbox.make_region(1 << 30, gates_open=False)  # no close to answer
    sandbox.start_heartbeat()
    region.set_gate(0, False, armed=True)
    bell, seq = region.doorbell(0), region.close_seq(0)
    result = sandbox.workload("launch", "5", "sleep_0", timeout=30)
    assert result.stdout == "launch 5 rc=0\n", result.stderr
    activity = region.activity(0)
    assert activity.launches == 5
    assert activity.pending == 0, "nobody waited at the gate"
    # one ring for the arming (not one per launch), one as the process exits
    assert region.doorbell(0) - bell == 2
    assert region.close_seq(0) == seq, "arming a closed gate is no close"
    region.set_gate(0, False)  # disarmed: what passed may still run, so this is a close
    assert region.close_seq(0) == seq + 1


def test_a_gate_closed_after_arming_holds_launches_again(sandbox: Sandbox) -> None:
    region = sandbox.make_region(1 << 30)
    sandbox.start_heartbeat()
    region.set_gate(0, False, armed=True)
    region.set_gate(0, False)
    proc = start(sandbox, "exported", LAUNCHES["cuLaunchKernel"])
    go(proc)
    wait_pending(region, 1)
    wait_parked(proc)
    assert proc.poll() is None, "the launch went through a disarmed gate"
    region.set_gate(0, False, armed=True)  # arming wakes the waiter, which passes
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, out + err
    assert region.activity(0).pending == 0


def drain_answer(region: region_mod.Region, seq: int) -> region_mod.ProcGpu:
    """The process's slot line once it has answered close `seq`."""
    deadline = time.monotonic() + 30  # a hang guard only
    while True:
        lines = [region.slot_gpu(slot, 0) for slot in region.live_slots()]
        if lines and lines[0].drained_seq == seq:
            return lines[0]
        assert time.monotonic() < deadline, f"close {seq} never answered: {lines}"
        time.sleep(0.005)


def test_a_process_stops_at_its_slices_end_and_answers_the_close_ahead(
        sandbox: Sandbox) -> None:
    """The gate stays open, but the slice's end the daemon named has come: the
    process's watcher waits for its queued kernel, answers the close to come
    (close_seq + 1) and rings; its next launch waits as at a closed gate. The
    daemon's close is then answered already (no second answer); a new grant
    with no end lets the launch go."""
    region = sandbox.make_region(1 << 30)
    sandbox.start_heartbeat()
    started = time.monotonic_ns()
    proc = sandbox.popen([str(sandbox.built.workload), "launch", "1", "sleep_200000",
                          "wait", "launch", "1", "sleep_0"])
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "launch 1 rc=0\n"
        assert proc.stdout.readline() == "waiting\n"
        [slot] = region.live_slots()
        assert region.slot_gpu(slot, 0).closes_itself == 1, "its slot says it does"
        seq, bell = region.close_seq(0), region.doorbell(0)
        region.set_close_at(0, time.monotonic_ns())
        line = drain_answer(region, seq + 1)
        assert line.drained_ns >= started + 200_000_000, "answered once its kernel had run"
        assert region.doorbell(0) > bell, "and rang"
        assert region.gate_is_open(0), "the daemon closed nothing"
        assert region.close_seq(0) == seq
        go(proc)
        wait_pending(region, 1)
        wait_parked(proc)
        assert proc.poll() is None, "a launch went through after the slice's end"
        answered = region.slot_gpu(slot, 0).drained_ns
        region.set_gate(0, False)
        assert region.close_seq(0) == seq + 1, "the close it answered ahead"
        region.set_close_at(0, 0)
        region.set_gate(0, True)
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, out + err
        assert out.endswith("launch 1 rc=0\n")
        assert region.slot_gpu(slot, 0).drained_ns == answered, "one answer for that close"
    finally:
        proc.kill()
        proc.communicate()
