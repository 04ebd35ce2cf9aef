"""Measured on simgpu: the real daemon and FUSE tree, containers started with `cgpu-run`.

Every figure is what the containers' workloads completed (`sharework` counts
its kernels), compared with a fixed target: the policy's share of the GPU's
time, which a container fills with `kernels * us` of kernel time. Bounds are
generous (this host is shared and small); `make bench` prints the precise
figures.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cgpu_km.daemon.snapshot import read_snapshot
from cgpu_km.dataplane.region import GATE_CLOSED, Region
from tests.bench.shares import Report, Workload, fraction, measure, started, summarize
from tests.daemon.simbox import VENV_BIN, SimHost, held_at, missing

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))
US = 1000  # 1 ms kernels
# A busy GPU, as a share of its time: every handover costs a few wake-ups of the daemon
# and the workloads, milliseconds on this shared 2-core host (0.95 failed a CI run at
# 0.949; here it was 0.99; on 2026-12-07 the 1:2 pair read 0.86 at 4a806e3 and 0.86 to
# 0.90 at d4d9a0c, so 0.90 failed a CI run at 0.898). An idling scheduler loses whole
# slices, far more than this.
BUSY = 0.85


@pytest.fixture
def host(tmp_path: Path, control_tree: Path) -> Iterator[SimHost]:
    sim = SimHost(tmp_path, control_tree, gpus=2)
    yield sim
    sim.close()


def steady(report: Report, seconds: float) -> float:
    """The share of the GPU's time it filled from 1 s to the end."""
    return fraction(report, US, report.t0 + 1, report.t0 + seconds)


def settled(report: Report, start: float, end: float, ok: Callable[[float], bool],
            what: str) -> float:
    """The earliest time from `start` (in 0.1 s steps) from which the share it filled up
    to `end`, at least 1 s later, is `ok`: when a change showed in the share, printed
    but never bounded (this host's stalls would make a bound flaky: what the promise
    bounds is asserted from the daemon's and libcgpu's own records). AssertionError if
    it never did."""
    at = start
    while end - at >= 1:
        share = fraction(report, US, at, end)
        if ok(share):
            print(f"{what}: a share of {share:.2f} from {at - start:.1f} s after it to the end")
            return at
        at += 0.1
    raise AssertionError(f"{what}: never, shares {fraction(report, US, start, end):.2f} "
                         "from then to the end")


def test_weighted_one_to_two(host: SimHost) -> None:
    host.echo("0/policy", 2)
    host.start_daemon()
    got = measure(host, [Workload("a", US, weight=1), Workload("b", US, weight=2)], 6)
    summary = summarize(got["a"], got["b"], 6, target=2.0)
    assert abs(summary.steady_error) <= 0.05, summary
    assert steady(got["a"], 6) + steady(got["b"], 6) >= BUSY  # and the GPU stays busy
    # The snapshot names the rules the turns took: libcgpu closes each holder at the
    # slice's end it was told and answers ahead, so slices end with company at the
    # step that sees that answer (`ended`), with a grant, not in a close and a drain
    # (`turns`, `answered`); and that one step is the dispatcher's one wake a turn.
    snapshot = read_snapshot(host.state_dir / "snapshot.json")
    assert snapshot is not None
    gpu = snapshot.gpu(0)
    assert gpu is not None
    moves = {move.row: move.count for move in gpu.dispatch_moves}
    turns = moves.get("ended", 0) + moves.get("turns", 0)
    assert turns > 100, moves
    assert moves.get("ended", 0) >= 0.9 * turns, moves
    assert gpu.dispatch_wakes < 1.5 * turns, (gpu.dispatch_wakes, moves)


def test_fair_share_caps_at_one_over_max_inst(host: SimHost) -> None:
    host.echo("0/policy", 0)
    host.echo("0/max_inst", 4)
    host.start_daemon()
    got = measure(host, [Workload("a", US), Workload("b", US)], 5)
    for name in ("a", "b"):
        assert held_at(steady(got[name], 5), 0.25), (name, steady(got[name], 5))


def test_preemptive_lone_active_container_gets_the_gpu(host: SimHost) -> None:
    host.start_daemon()
    host.idle("idle")
    got = measure(host, [Workload("a", US)], 4)
    assert steady(got["a"], 4) >= BUSY


def test_soft_lends_idle_time_then_shares_by_weight(host: SimHost) -> None:
    host.echo("0/policy", 4)
    host.start_daemon()
    host.idle("idle", weight=2)  # registered, never active: its time is lent
    with started(host, [Workload("a", US, weight=1)], 11) as alone:
        alone.sleep_until(3)
        with started(host, [Workload("b", US, weight=2)], 5) as joined:
            b = joined.reports()["b"]
        a = alone.reports()["a"]
    assert fraction(a, US, a.t0 + 1, a.t0 + 3) >= BUSY
    both = summarize(a, b, 5, target=2.0)  # from b's start: a's buckets share b's clock
    assert abs(both.steady_error) <= 0.08, both


def test_fixed_holds_weight_over_max_inst(host: SimHost) -> None:
    host.echo("0/policy", 3)
    host.echo("0/max_inst", 8)
    host.start_daemon()
    host.idle("b", weight=1)
    got = measure(host, [Workload("a", US, weight=2)], 5)
    assert held_at(steady(got["a"], 5), 0.25), steady(got["a"], 5)


def test_highprio_takes_prio_ratio(host: SimHost) -> None:
    host.echo("0/prio_ratio", 70)
    host.start_daemon()
    got = measure(host, [Workload("hp", US, highprio=True), Workload("b", US, procs=2)], 6)
    assert steady(got["hp"], 6) == pytest.approx(0.70, abs=0.05)


def test_util_limit_caps(host: SimHost) -> None:
    host.start_daemon()
    got = measure(host, [Workload("a", US, util_limit=30)], 5)
    assert held_at(steady(got["a"], 5), 0.30), steady(got["a"], 5)


def configurations(host: SimHost, gpu: int, policy: int) -> list[tuple[int, int]]:
    """(steps taken when it was handed over, the step that ran it) of each new
    configuration with `policy` that the dispatcher of `gpu` logged."""
    pattern = (rf"GPU {gpu}: a configuration handed over after step (\d+) ran at step (\d+) "
               rf"\(policy {policy}\)")
    return [(int(m[1]), int(m[2])) for m in re.finditer(pattern, host.daemon_log())]


def test_policy_echo_runs_at_the_next_step_and_caps(host: SimHost) -> None:
    host.echo("0/max_inst", 4)
    host.start_daemon(0.05)
    with started(host, [Workload("a", US)], 7) as run:
        run.sleep_until(3)
        echoed = time.monotonic()
        host.echo("0/policy", 0)
        a = run.reports()["a"]
    assert fraction(a, US, a.t0 + 1, a.t0 + 3) >= BUSY
    # "The daemon applies a change within one scheduling period": the step after the
    # dispatcher was handed the new policy ran it.
    handed = configurations(host, 0, 0)
    assert handed, "the dispatcher never ran policy 0"
    for before, ran in handed:
        assert ran - before <= 1, f"handed over after step {before}, ran at step {ran}"
    settled(a, echoed, a.t0 + 7, lambda share: share <= 0.27, "capped at 1/4")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["KILL", "TERM"])
def test_a_dead_daemon_never_leaves_workloads_blocked(host: SimHost, sig: int) -> None:
    host.echo("0/policy", 0)
    host.echo("0/max_inst", 10)
    host.start_daemon()
    with started(host, [Workload("a", US)], 12) as run:  # 9 s after the kill: a hang guard
        region = Region.open(host.region_dir / "a")
        run.sleep_until(3)
        host.kill_daemon(sig)
        gone = time.monotonic()
        # A stopped daemon opens the gates as it exits; a killed one leaves them as they
        # were, and a closed one fails open once the heartbeat is 2 s old: the waiting
        # launch records the heartbeat it judged stale and when it went on.
        closed = region.gate(0) == GATE_CLOSED
        assert not closed or sig == signal.SIGKILL
        record = region.failed_open(0)
        while closed and record is None and time.monotonic() < gone + 8:
            time.sleep(0.05)
            record = region.failed_open(0)
        beat, timeout = region.heartbeat_ns, region.gate_timeout_ns
        region.close()
        a = run.reports()["a"]
    assert fraction(a, US, a.t0 + 1, a.t0 + 3) <= 0.12
    if closed:
        assert record is not None, "no launch failed open at the closed gate"
        assert record.heartbeat_ns == beat, record
        assert record.age_ns >= timeout == 2_000_000_000, record
        assert 0 < record.wake_ns <= beat + timeout, record
        print(f"failed open with the heartbeat {record.age_ns / 1e9:.3f} s old")
    else:
        assert record is None, "a launch waited at a gate the daemon left open"
    settled(a, gone, a.t0 + 12, lambda share: share >= BUSY, "the gates open")


def test_a_restarted_daemon_reattaches_and_holds_the_share_again(host: SimHost) -> None:
    host.echo("0/policy", 0)
    host.echo("0/max_inst", 5)
    host.start_daemon()
    with started(host, [Workload("a", US)], 10) as run:
        run.sleep_until(3)
        host.kill_daemon(signal.SIGKILL)
        host.start_daemon()  # a new process: the tree, the region and the workload are as they were
        back = time.monotonic()
        a = run.reports()["a"]
    assert held_at(fraction(a, US, a.t0 + 1, a.t0 + 3), 0.20)
    settled(a, back, a.t0 + 10, lambda share: held_at(share, 0.20),
            "the share held again")
    assert "restored scheduler state" in host.daemon_log()


def test_two_gpus_are_scheduled_independently(host: SimHost) -> None:
    host.echo("0/policy", 2)
    host.echo("1/policy", 0)
    host.echo("1/max_inst", 4)
    host.start_daemon()
    got = measure(host, [Workload("a", US, gpu=0, weight=1), Workload("b", US, gpu=0, weight=2),
                         Workload("c", US, gpu=1)], 6)
    summary = summarize(got["a"], got["b"], 6, target=2.0)
    assert abs(summary.steady_error) <= 0.08, summary
    assert held_at(steady(got["c"], 6), 0.25), steady(got["c"], 6)


def thread_policies(pid: int) -> dict[str, set[tuple[int, int]]]:
    """Each thread name of `pid`: the (policy, priority) its threads run under."""
    found: dict[str, set[tuple[int, int]]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            policy = (os.sched_getscheduler(int(task.name)),
                      os.sched_getparam(int(task.name)).sched_priority)
        except (FileNotFoundError, ProcessLookupError):
            continue
        found.setdefault(name, set()).add(policy)
    return found


@pytest.mark.parametrize("priority", [None, 0, 3])
def test_dispatchers_run_under_sched_fifo_and_nothing_else_does(host: SimHost,
                                                                 priority: int | None) -> None:
    """As the kernel says: each GPU's dispatcher thread (named for its GPU) under
    SCHED_FIFO at `--dispatch-priority` (default 1), every other thread of the
    daemon under the default policy; the snapshot says the same."""
    host.start_daemon(0.02, *(() if priority is None else ("--dispatch-priority",
                                                             str(priority))))
    assert host.daemon is not None
    want = 1 if priority is None else priority
    # (a child it forked would start under the default policy: SCHED_RESET_ON_FORK)
    fifo = {(os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, want)} if want else {(os.SCHED_OTHER, 0)}
    found = thread_policies(host.daemon.pid)
    assert {name: found.pop(name, set()) for name in ("cgpu-gpu0", "cgpu-gpu1")} == {
        "cgpu-gpu0": fifo, "cgpu-gpu1": fifo}
    assert set().union(*found.values()) == {(os.SCHED_OTHER, 0)}, found
    snapshot = read_snapshot(host.state_dir / "snapshot.json")
    assert snapshot is not None
    assert [gpu.dispatch_scheduling for gpu in snapshot.gpus] == [
        f"SCHED_FIFO {want}" if want else "default policy"] * 2


def test_a_bad_dispatch_priority_is_refused(host: SimHost) -> None:
    result = subprocess.run([str(VENV_BIN / "cgpu-daemon"), "--root", str(host.root),
                             "--dispatch-priority", "100"],
                            env=host.env, capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 2
    assert "dispatch_priority must be 0 (the default policy) or a SCHED_FIFO priority 1-99, " \
        "not 100" in result.stderr


def test_a_holder_that_said_it_went_idle_hands_over_without_a_drain(host: SimHost) -> None:
    """Three containers under policy 2 whose requests (2 x 1 ms every 20 ms)
    follow each other 1 ms apart, within the 2 ms idle grace: libcgpu's watcher
    puts its report in the slot as soon as its queue is empty, before its ring,
    so the next request's wake (rested: it takes the GPU at once) finds it and
    takes the GPU by the `vacated` row (the holder paid up to its report, no
    drain shared). With the report written only at its ring, every one of
    those wakes would be a handover."""
    host.echo("0/policy", 2)
    host.echo("0/max_inst", 3)
    host.start_daemon(0.02)
    got = measure(host, [Workload(f"r{i}", US, weight=1, request_ms=20, phase_ms=3 * i)
                         for i in range(3)], 3)
    assert all(report.kernels for report in got.values()), "every container ran"
    snapshot = read_snapshot(host.state_dir / "snapshot.json")
    assert snapshot is not None
    gpu = snapshot.gpu(0)
    assert gpu is not None
    moves = {move.row: move.count for move in gpu.dispatch_moves}
    print("moves:", moves)
    assert moves.get("vacated", 0) > 0, moves
