"""The stops service in trio's mock time, with a fake data plane: no stop waits
for another, the SIGKILL waits for nothing, OOM scripts take turns in a pool of
their own while their processes wait frozen, a script past its deadline is
killed, a stop that did not see its process go is asked for again, and what a
script says is quoted in the journal as the script's.

Times here are the mock clock's: each assertion on one is exact, and none is a
wall-clock deadline.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import trio.testing

from cgpu_km.daemon.context import Settings
from cgpu_km.daemon.core import Daemon
from cgpu_km.daemon.stops import GONE_WAIT, Stops
from tests.daemon.fakes import FakePlane, MemoryTree

T = TypeVar("T")
A, B = (0, "a"), (0, "b")
TIMEOUT = 5.0  # the OOM scripts' deadline (the default)


async def direct(fn: Callable[[], T]) -> T:
    return fn()


@contextlib.asynccontextmanager
async def serving(plane: FakePlane, **settings: Any) -> AsyncIterator[Stops]:
    stops = Stops(plane, Settings(**settings), blocking=direct)
    async with trio.open_nursery() as nursery:
        await nursery.start(stops.serve)
        yield stops
        nursery.cancel_scope.cancel()


def egpu_plane(pids: dict[int, int], script: str = "/oom.sh") -> FakePlane:
    """Container a (eGPU, with an OOM script) holding `pids`; container b (cGPU)."""
    plane = FakePlane()
    plane.memory_by[A] = dict(pids)
    plane.memory_by[B] = {}
    plane.egpu_keys.add(A)
    plane.oom_scripts[A] = script
    return plane


async def test_without_a_script_the_sigkill_comes_at_once(
    autojump_clock: trio.testing.MockClock
) -> None:
    plane = egpu_plane({10: 1}, script="")
    plane.memory_by[B] = {20: 1}
    async with serving(plane) as stops:
        await trio.sleep(1)
        assert stops.request(B, 20, reason="bypass", oom_script=False)
        assert stops.in_flight(B, 20)
        assert not stops.request(B, 20, reason="bypass", oom_script=False), "one at a time"
        assert stops.request(A, 10, reason="memory", oom_script=True)  # eGPU, no script
        await trio.sleep(1)
    assert plane.times("kill", 20) == [1.0]
    assert plane.times("kill", 10) == [1.0]
    assert plane.times("freeze", 10) == [], "nothing to wait for: not frozen"
    assert dict(stops.counts("bypass")) == {B: 1}
    assert dict(stops.counts("memory")) == {A: 1}
    assert dict(stops.counts("compute")) == {}
    assert [r.outcome for r in stops.records] == ["stopped", "stopped"]
    assert not stops.in_flight(B, 20)


async def test_a_process_is_frozen_while_its_script_runs_then_killed(
    autojump_clock: trio.testing.MockClock
) -> None:
    plane = egpu_plane({10: 1})
    plane.script_seconds = 2.0
    async with serving(plane) as stops:
        stops.request(A, 10, reason="memory", oom_script=True)
        await trio.sleep(10)
    assert [what for _at, what, _key, _pid in plane.events] == [
        "pin", "freeze", "script", "script end", "kill"]
    assert plane.times("freeze", 10) == [0.0]
    assert plane.times("kill", 10) == [pytest.approx(2.0)], "killed as the script ended"
    record = stops.records[0]
    assert (record.script_outcome, record.outcome) == ("exit 0", "stopped")
    assert plane.stopped_with_script == [True]


async def test_a_script_that_does_not_end_is_killed_at_its_deadline(
    autojump_clock: trio.testing.MockClock
) -> None:
    plane = egpu_plane({10: 1})
    plane.script_seconds = None  # a `sleep 30`, or a child that holds the output
    async with serving(plane) as stops:
        stops.request(A, 10, reason="memory", oom_script=True)
        await trio.sleep(20)
    record = stops.records[0]
    assert record.killed is not None
    assert record.frozen is not None
    assert record.killed - record.frozen == pytest.approx(TIMEOUT)
    assert plane.times("script end", 10) == [pytest.approx(TIMEOUT)], \
        "the script killed at its deadline"
    assert record.script_outcome == f"killed at its {TIMEOUT:g} s deadline"


async def test_scripts_take_turns_while_their_processes_wait_frozen_and_no_stop_waits(
    autojump_clock: trio.testing.MockClock
) -> None:
    """Six hanging scripts (asked for 10 ms apart), four at a time: every process is
    frozen at once; the fifth and sixth scripts run as the first and second are
    killed. A stop without a script, asked for meanwhile, is done at once."""
    plane = egpu_plane({pid: 1 for pid in range(10, 16)})
    plane.memory_by[B] = {20: 1}
    plane.script_seconds = None
    step = 0.01
    async with serving(plane) as stops:
        for pid in range(10, 16):
            stops.request(A, pid, reason="memory", oom_script=True)
            await trio.sleep(step)
        await trio.sleep(1)
        stops.request(B, 20, reason="bypass", oom_script=False)
        asked = trio.current_time()
        await trio.sleep(20)
    approx = pytest.approx
    for n, pid in enumerate(range(10, 16)):
        assert plane.times("freeze", pid) == [approx(n * step)]
    starts = [n * step for n in range(4)] + [TIMEOUT + n * step for n in range(2)]
    assert [plane.times("script", pid)[0] for pid in range(10, 16)] == \
        [approx(start) for start in starts]
    assert [plane.times("kill", pid)[0] for pid in range(10, 16)] == \
        [approx(start + TIMEOUT) for start in starts]
    assert plane.times("kill", 20) == [asked]


async def test_a_process_waits_for_a_turn_no_longer_than_the_stop_deadline_allows(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """One script at a time, each hanging: a process waits frozen for a turn at most
    the stop's deadline (15 s) less the script's (5 s), so that it is killed within
    the stop's deadline; past that its script does not run."""
    plane = egpu_plane({10: 1, 11: 1, 12: 1, 13: 1})
    plane.script_seconds = None
    turn_wait = 15.0 - TIMEOUT
    approx = pytest.approx
    async with serving(plane, oom_scripts=1, stop_deadline=15.0) as stops:
        for pid, at in ((10, 0.0), (11, 1.0), (12, 1.5), (13, 2.0)):
            await trio.sleep_until(at)
            stops.request(A, pid, reason="memory", oom_script=True)
        await trio.sleep(30)
    assert plane.times("script", 11) == [approx(TIMEOUT)], "its turn came while it waited"
    assert plane.times("script", 12) == [approx(2 * TIMEOUT)]
    assert plane.times("kill", 12) == [approx(3 * TIMEOUT)], "within 15 s of its request"
    assert plane.times("script", 13) == [], "no turn within its wait: no script"
    assert plane.times("kill", 13) == [approx(2.0 + turn_wait)]
    assert f"OOM script /oom.sh for pid 13 not run: the node's 1 OOM scripts at a time " \
        f"left it no turn in {turn_wait:g} s" in caplog.text


async def test_a_process_still_there_after_sigkill_is_tried_again_without_its_script(
    autojump_clock: trio.testing.MockClock
) -> None:
    plane = egpu_plane({10: 1})
    plane.unkillable.add(10)
    async with serving(plane) as stops:
        assert stops.request(A, 10, reason="memory", oom_script=True)
        await trio.sleep(GONE_WAIT + 1)
        assert stops.records[-1].outcome == "still there"
        assert stops.request(A, 10, reason="memory", oom_script=True), "a retry"
        await trio.sleep(0.5)
        plane.unkillable.discard(10)
        await trio.sleep(GONE_WAIT + 1)
    assert [r.outcome for r in stops.records] == ["still there", "stopped"]
    assert [r.attempt for r in stops.records] == [1, 2]
    assert plane.times("script", 10) == [0.0], "the retry ran no script"
    assert plane.stopped_with_script == [True, False]
    assert dict(stops.counts("memory")) == {A: 1}, "one process, counted once"


async def test_a_stop_cancelled_on_the_way_still_kills_its_process(
    autojump_clock: trio.testing.MockClock
) -> None:
    """The daemon exits while a script runs: the process it froze is killed, not left
    stopped."""
    plane = egpu_plane({10: 1})
    plane.script_seconds = None
    async with serving(plane) as stops:
        stops.request(A, 10, reason="memory", oom_script=True)
        await trio.sleep(1)
    assert plane.times("kill", 10) == [1.0]
    assert stops.records[0].outcome == ""


async def test_what_a_script_says_is_quoted_under_its_container_and_pid(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A script's output cannot pass for the daemon's own lines: each line is quoted,
    its control characters escaped, under the script's container and pid."""
    caplog.set_level(logging.INFO, logger="cgpu-daemon")
    plane = egpu_plane({10: 1})
    plane.script_status = 3
    plane.script_output = (b"first\n" + b"x" * 300 + b"\n"
                           b"\x1b[2K\rcontainer b on GPU 0: pid 20 stopped\n"
                           b"not utf-8 \xff\n")
    async with serving(plane) as stops:
        stops.request(A, 10, reason="memory", oom_script=True)
        await trio.sleep(1)
    lines = [r.getMessage() for r in caplog.records]
    head = "container a on GPU 0: OOM script /oom.sh for pid 10"
    assert f"{head} exited with status 3" in lines
    said = [line for line in lines if " said: " in line]
    assert said == [
        f"{head} said: '{'x' * 200}...'",
        f"{head} said: '\\x1b[2K\\rcontainer b on GPU 0: pid 20 stopped'",
        f"{head} said: 'not utf-8 \\\\xff'",
    ]
    assert f"{head} wrote {len(plane.script_output)} bytes; its last lines follow" in lines
    assert not any(line.startswith("container b") for line in lines)
    assert all("\n" not in line and "\x1b" not in line for line in lines)


def test_a_reason_must_be_known() -> None:
    stops = Stops(FakePlane(), Settings(), blocking=direct)
    with pytest.raises(ValueError, match="reason must be one of memory, bypass, compute"):
        stops.request(A, 10, reason="cpu", oom_script=False)


def test_oom_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="oom_scripts must be a positive count"):
        Settings(oom_scripts=0)
    with pytest.raises(ValueError, match="oom_script_timeout must be a positive number"):
        Settings(oom_script_timeout=float("inf"))


async def test_a_bypasser_is_stopped_while_hanging_oom_scripts_fill_the_pool(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """The starvation case of issue 36, with the daemon's services: eight processes of
    an eGPU container over its limit in two waves 2 s apart, each with an OOM script
    that hangs; then a process of a cGPU container that holds GPU memory without
    libcgpu. It is killed in the memory round that sees it, before any of the eight
    (each of which gets its script's whole deadline), and each of them is stopped."""
    tree = MemoryTree.with_gpus(1, policy=1)
    tree.add(0, "a", memsize=100)
    tree.add(0, "b")
    plane = egpu_plane({})
    plane.script_seconds = None
    interval = 0.1
    settings = Settings(period=0.02, tree_refresh=0.5, memory_interval=interval,
                        publish_interval=0.5)
    daemon = Daemon(tree, plane, state_dir=tmp_path, blocking=direct, settings=settings,
                    wall_clock=trio.current_time)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        start = trio.current_time()
        plane.memory_by[A] = {pid: 300 for pid in range(10, 14)}  # each over the limit
        await trio.sleep(2)
        plane.memory_by[A].update({pid: 300 for pid in range(14, 18)})
        await trio.sleep(0.5)
        plane.memory_by[B] = {20: 100}
        plane.unmanaged[B] = {20}
        await trio.sleep(30)
        nursery.cancel_scope.cancel()
    bypass_kill = plane.times("kill", 20)
    assert len(bypass_kill) == 1
    assert bypass_kill[0] - start <= 2.5 + interval, "in the round that saw it"
    egpu = {pid: plane.times("kill", pid) for pid in range(10, 18)}
    assert all(len(kills) == 1 for kills in egpu.values()), egpu
    assert min(kills[0] for kills in egpu.values()) > bypass_kill[0]
    for pid in range(10, 18):
        record = next(r for r in daemon.stops.records if r.pid == pid)
        assert record.script_outcome == f"killed at its {TIMEOUT:g} s deadline"
        assert record.script_ended is not None
        assert record.script_started is not None
        assert record.script_ended - record.script_started == pytest.approx(TIMEOUT)
    assert dict(daemon.memory.bypass_stopped) == {B: 1}
    assert dict(daemon.memory.stopped) == {A: 8}
