"""The daemon in trio's mock time, with an in-memory tree and a data plane on engine models."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import trio.testing

from cgpu_km.daemon import STATE_NAME, UPGRADED_ENV, Daemon, Settings, over_limit, run_with_signals
from cgpu_km.daemon_sim import MemoryTree, SimPlane
from cgpu_km.sched_sim import SimProcess
from cgpu_km.sdnotify import Notifier

T = TypeVar("T")
PERIOD = 0.02


class RecordingNotifier(Notifier):
    def __init__(self) -> None:
        super().__init__({})
        self.sent: list[str] = []
        self._changed = trio.Event()

    def notify(self, *lines: str) -> bool:
        self.sent.extend(lines)
        self._changed.set()
        return True

    async def wait_for(self, line: str, count: int = 1) -> None:
        while self.sent.count(line) < count:
            self._changed = trio.Event()
            await self._changed.wait()


async def direct(fn: Callable[[], T]) -> T:
    return fn()


def make_daemon(
    tree: MemoryTree, plane: SimPlane, tmp_path: Path, **kw: Any
) -> tuple[Daemon, RecordingNotifier]:
    notifier = RecordingNotifier()
    daemon = Daemon(
        tree, plane, state_dir=tmp_path, notifier=notifier, blocking=direct,
        settings=Settings(period=PERIOD, tree_refresh=0.5, memory_interval=0.1,
                          publish_interval=0.5),
        wall_clock=trio.current_time, **kw,
    )
    return daemon, notifier


def two_containers(policy: int, weights: tuple[int, int] = (1, 2)) -> tuple[MemoryTree, SimPlane]:
    tree = MemoryTree.with_gpus(1, policy=policy)
    tree.add(0, "a", weights[0])
    tree.add(0, "b", weights[1])
    plane = SimPlane(trio.current_time, {0: [SimProcess("a", 0.002), SimProcess("b", 0.002)]})
    return tree, plane


def shares(
    plane: SimPlane, since: dict[tuple[int, str], float], seconds: float
) -> dict[str, float]:
    now = plane.busy()
    return {name: (now[(g, name)] - since.get((g, name), 0.0)) / seconds for (g, name) in now}


async def test_weighted_shares_hold_and_ready_is_reported(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=2)
    daemon, notifier = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        assert "READY=1" in notifier.sent
        await trio.sleep(20)
        got = shares(plane, {}, 20)
        nursery.cancel_scope.cancel()
    assert got["b"] / got["a"] == pytest.approx(2.0, rel=0.02)
    assert plane.heartbeats >= 75  # every HEARTBEAT_INTERVAL (0.25 s) for 20 s
    assert plane.all_open
    assert "STOPPING=1" in notifier.sent


async def test_policy_echo_takes_effect_within_one_period(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=1)
    tree.gpus[0].max_inst = 4
    daemon, _ = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        await trio.sleep(1)
        tree.gpus[0].policy = 0
        await trio.sleep(PERIOD * 2)
        decision = daemon.gpus[0].decision
        assert decision is not None
        assert decision.shares["a"] == decision.shares["b"] == pytest.approx(0.25)
        before = plane.busy()
        await trio.sleep(10)
        got = shares(plane, before, 10)
        nursery.cancel_scope.cancel()
    assert got["a"] == pytest.approx(0.25, abs=0.01)
    assert got["b"] == pytest.approx(0.25, abs=0.01)


async def test_weight_change_and_new_container_are_picked_up(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=4, weights=(1, 1))
    daemon, _ = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        await trio.sleep(1)
        tree.gpus[0].containers["b"].weight = 3
        await trio.sleep(0.5 + 2 * PERIOD)  # the full re-read interval
        before = plane.busy()
        await trio.sleep(10)
        got = shares(plane, before, 10)
        tree.add(0, "c", 4)
        await trio.sleep(2 * PERIOD)
        assert "c" in daemon.gpus[0].scheduler.config.containers
        del tree.gpus[0].containers["c"]
        await trio.sleep(2 * PERIOD)
        assert "c" not in daemon.gpus[0].scheduler.config.containers
        nursery.cancel_scope.cancel()
    assert got["b"] / got["a"] == pytest.approx(3.0, rel=0.03)


async def test_meminfo_is_fed_once_per_change_and_backstop_stops_the_largest(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=1)
    tree.gpus[0].containers["a"].memsize = 1000
    plane.memory_by[0, "a"] = {10: 300, 11: 200}
    daemon, _ = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        await trio.sleep(1)
        assert tree.gpus[0].containers["a"].procs == {10: 300, 11: 200}
        assert tree.gpus[0].containers["b"].procs == {}
        writes = len(tree.meminfo_writes)
        await trio.sleep(1)
        assert len(tree.meminfo_writes) == writes  # unchanged: not written again
        plane.memory_by[0, "a"] = {10: 900, 11: 200, 12: 50}
        await trio.sleep(0.3)
        nursery.cancel_scope.cancel()
    assert plane.stopped == [(0, "a", [10])]
    assert tree.gpus[0].containers["a"].procs == {11: 200, 12: 50}


def test_over_limit_picks_largest_first_and_ignores_unlimited() -> None:
    assert over_limit({1: 5, 2: 7, 3: 1}, 6) == [2]
    assert over_limit({1: 5, 2: 7, 3: 1}, 2) == [2, 1]
    assert over_limit({1: 5}, 5) == []
    assert over_limit({1: 5}, 0) == []


async def test_state_survives_a_restart(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=2)
    first, _ = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        await trio.sleep(3)
        nursery.cancel_scope.cancel()
    saved = json.loads((tmp_path / STATE_NAME).read_text())
    assert set(saved["gpus"]["0"]["accounts"]) == {"a", "b"}
    credits = first.gpus[0].scheduler.credits()
    second, _ = make_daemon(tree, plane, tmp_path)
    second.load_state()
    await second._read_all()  # what `run` does first, before any period is charged
    assert second.gpus[0].scheduler.credits() == pytest.approx(credits)
    assert second.gpus[0].scheduler.to_state()["accounts"] == saved["gpus"]["0"]["accounts"]


async def test_stale_or_broken_state_is_ignored(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=2)
    (tmp_path / STATE_NAME).write_text("{not json")
    daemon, _ = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        assert daemon.gpus[0].scheduler.credits() == {"a": 0.0, "b": 0.0}
        nursery.cancel_scope.cancel()


async def test_upgrade_saves_state_reexecs_and_the_new_daemon_writes_zero(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree, plane = two_containers(policy=2)
    restarted = trio.Event()
    first, notifier = make_daemon(tree, plane, tmp_path, restart=restarted.set)
    monkeypatch.delenv(UPGRADED_ENV, raising=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        await trio.sleep(1)
        tree.upgrade = 1
        with trio.fail_after(2 * PERIOD + 0.001):
            await restarted.wait()
        nursery.cancel_scope.cancel()
    assert first.upgrading
    assert not plane.all_open  # a hot update does not touch the gates
    assert "STOPPING=1" not in notifier.sent
    assert os.environ[UPGRADED_ENV] == "1"
    assert tree.upgrade == 1
    saved = json.loads((tmp_path / STATE_NAME).read_text())
    assert set(saved["gpus"]["0"]["accounts"]) == {"a", "b"}
    second, _ = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(second.run)
        assert tree.upgrade == 0
        assert UPGRADED_ENV not in os.environ
        assert second._saved_state == saved
        nursery.cancel_scope.cancel()


async def test_waits_for_the_tree_then_starts(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=1)
    tree.fail = True
    daemon, notifier = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        started = trio.Event()

        async def start() -> None:
            await nursery.start(daemon.run)
            started.set()

        nursery.start_soon(start)
        await trio.sleep(1)
        assert not started.is_set()
        assert "READY=1" not in notifier.sent
        tree.fail = False
        await trio.sleep(2 * PERIOD)
        assert started.is_set()
        # A tree that goes away later keeps the last view and the schedulers running.
        tree.fail = True
        ticks = daemon.gpus[0].ticks
        await trio.sleep(1)
        assert daemon.gpus[0].ticks > ticks
        nursery.cancel_scope.cancel()


async def test_watchdog_pings_only_while_schedulers_tick(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    tree, plane = two_containers(policy=1)
    daemon, notifier = make_daemon(tree, plane, tmp_path)
    stuck = False

    async def blocking(fn: Callable[[], T]) -> T:
        if stuck:  # a data-plane call that never returns
            await trio.sleep_forever()
        return fn()

    daemon._blocking = blocking
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        await trio.sleep(5.5)
        assert notifier.sent.count("WATCHDOG=1") == 5
        stuck = True
        await trio.sleep(3)  # pings stop within two watchdog intervals
        pings = notifier.sent.count("WATCHDOG=1")
        await trio.sleep(10)
        assert notifier.sent.count("WATCHDOG=1") == pings <= 7
        nursery.cancel_scope.cancel()


async def test_signals_hup_reloads_and_term_fails_open(tmp_path: Path) -> None:
    """Real signals, real time (short)."""
    tree, plane = two_containers(policy=1)
    daemon, notifier = make_daemon(tree, plane, tmp_path)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_with_signals, daemon)
            await notifier.wait_for("READY=1")
            reads = tree.reads
            os.kill(os.getpid(), signal.SIGHUP)
            await notifier.wait_for("READY=1", count=2)
            assert "RELOADING=1" in notifier.sent
            assert tree.reads > reads
            os.kill(os.getpid(), signal.SIGTERM)
    assert plane.all_open
    assert notifier.sent[-1] == "STOPPING=1"
    assert (tmp_path / STATE_NAME).exists()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="period must be a positive number"):
        Settings(period=0)
