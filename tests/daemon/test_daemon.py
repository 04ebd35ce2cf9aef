"""The daemon's services in trio's mock time, with an in-memory tree and a fake data plane.

The scheduling itself (slices, drains, shares) is the data plane's, tested
in tests/sched and on simgpu; here: what the daemon tells the plane, and
when, and that its services never wait for each other.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import trio.testing

from cgpu_km.daemon.context import Settings
from cgpu_km.daemon.core import Daemon
from cgpu_km.daemon.lifecycle import UPGRADED_ENV, run_with_signals
from cgpu_km.daemon.publishing import STATE_NAME
from cgpu_km.daemon.sdnotify import Notifier
from cgpu_km.dataplane.dispatch import Figures
from cgpu_km.sched import ContainerSpec, Policy
from cgpu_km.tree.views import LOST, Change
from tests.daemon.fakes import FakePlane, FakeWatcher, MemoryTree

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


def make_daemon(tree: MemoryTree, plane: FakePlane, tmp_path: Path, *, inline: bool = True,
                settings: Settings | None = None, **kw: Any) -> tuple[Daemon, RecordingNotifier]:
    notifier = RecordingNotifier()
    daemon = Daemon(
        tree, plane, state_dir=tmp_path, notifier=notifier,
        blocking=direct if inline else None,
        settings=settings or Settings(period=PERIOD, tree_refresh=0.5, memory_interval=0.1,
                                      publish_interval=0.5),
        wall_clock=trio.current_time if inline else time.time, **kw,
    )
    return daemon, notifier


def two_containers(policy: int, weights: tuple[int, int] = (1, 2)) -> MemoryTree:
    tree = MemoryTree.with_gpus(1, policy=policy)
    tree.add(0, "a", weights[0])
    tree.add(0, "b", weights[1])
    return tree


async def test_configuration_reaches_the_plane_and_ready_is_reported(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=2), FakePlane()
    daemon, notifier = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        assert "READY=1" in notifier.sent
        assert plane.attached == {0: {"a", "b"}}
        config = plane.configs[0]
        assert config.policy is Policy.WEIGHTED
        assert dict(config.containers) == {"a": ContainerSpec(1), "b": ContainerSpec(2)}
        nursery.cancel_scope.cancel()
    assert plane.closed, "every gate opens on the way out"
    assert "STOPPING=1" in notifier.sent


async def test_policy_echo_takes_effect_within_one_period(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=1), FakePlane()
    daemon, _ = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        await trio.sleep(1)
        tree.gpus[0].policy = 0
        tree.gpus[0].max_inst = 4
        await trio.sleep(PERIOD * 1.5)
        assert plane.configs[0].policy is Policy.FAIR_SHARE
        assert plane.configs[0].max_inst == 4
        nursery.cancel_scope.cancel()


async def test_weight_change_and_new_container_are_picked_up(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=4, weights=(1, 1)), FakePlane()
    daemon, _ = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        await trio.sleep(1)
        tree.gpus[0].containers["b"].weight = 3
        await trio.sleep(0.5 + 2 * PERIOD)  # the full re-read interval (no watcher here)
        assert plane.configs[0].containers["b"].weight == 3
        tree.add(0, "c", 4)
        await trio.sleep(2 * PERIOD)
        assert "c" in plane.configs[0].containers
        assert plane.attached[0] == {"a", "b", "c"}
        del tree.gpus[0].containers["c"]
        await trio.sleep(2 * PERIOD)
        assert "c" not in plane.configs[0].containers
        nursery.cancel_scope.cancel()


def watched_daemon(tmp_path: Path) -> tuple[MemoryTree, FakePlane, FakeWatcher, Daemon]:
    """Two containers at 1:1 under policy 4, a watcher the test speaks for, and slow
    polls (a minute, ten): what is read sooner is read because of the watch."""
    tree, plane = two_containers(policy=4, weights=(1, 1)), FakePlane()
    tree.watching = watcher = FakeWatcher()
    settings = Settings(period=PERIOD, tree_refresh=60, full_refresh=600, memory_interval=0.1,
                        publish_interval=0.5)
    daemon, _ = make_daemon(tree, plane, tmp_path, settings=settings)
    return tree, plane, watcher, daemon


async def test_lost_watch_events_make_the_daemon_read_every_container(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """A write the watcher did not name waits for the slow sweep; when the
    watcher's queue overflowed (events lost), every container is read at once."""
    tree, plane, watcher, daemon = watched_daemon(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        tree.gpus[0].containers["b"].weight = 3  # written while events were being lost
        watcher.say(Change(node="inst_ctl"))  # what still came: names only
        await trio.sleep(1)
        assert plane.configs[0].containers["b"].weight == 1
        watcher.say(LOST)
        await trio.sleep(2 * PERIOD)
        assert plane.configs[0].containers["b"].weight == 3
        nursery.cancel_scope.cancel()


async def test_a_tree_back_after_an_error_is_read_and_watched_at_once(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """cgpu-fuse restarts: the watches went with the old mount and say nothing more.
    Once the tree reads again it is read whole and watched anew within a period or
    two, not at the next slow poll: a container it lists then would otherwise be
    unknown for seconds, and its gates fail open after two."""
    tree, plane, watcher, daemon = watched_daemon(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        tree.fail = True  # unmounted: the old watches end, which the watch reports
        watcher.say(Change(node="upgrade"))
        await trio.sleep(1)
        synced = watcher.syncs
        tree.fail = False
        tree.add(0, "c", 2)  # registered on the new mount: no watch tells of it
        await trio.sleep(3 * PERIOD)
        assert "c" in plane.configs[0].containers
        assert watcher.syncs > synced, "the new mount is watched"
        nursery.cancel_scope.cancel()


async def test_a_missing_region_is_looked_for_every_period_and_only_then(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """A region made after the add is attached within a period; once none is
    missing, nothing is looked for until an attach leaves one missing again."""
    tree, plane = two_containers(policy=1), FakePlane()
    plane.missing_names = {"b"}
    daemon, _ = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        plane.attached = {}
        await trio.sleep(PERIOD * 1.5)
        assert plane.attached == {0: {"a", "b"}}, "looked again for the missing region"
        await trio.sleep(PERIOD * 2)
        assert plane.attaches >= 3, "looked every period while b's region was missing"
        plane.missing_names = set()
        await trio.sleep(PERIOD * 2.5)  # the look that finds none missing, and one more
        settled, looks = plane.attaches, plane.missing_looks
        await trio.sleep(PERIOD * 20)
        # (the slow safety sweep attaches again, and looks once after that)
        assert plane.missing_looks - looks == plane.attaches - settled, (
            "no look every period while nothing is missing")
        plane.missing_names = {"b"}  # the region went: the next attach notices
        tree.add(0, "c", 1)
        await trio.sleep(PERIOD * 3.5)
        assert plane.attaches >= settled + 3
        nursery.cancel_scope.cancel()


async def test_memsize_written_live_reaches_the_region(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=1), FakePlane()
    tree.gpus[0].containers["a"].memsize = 4000
    daemon, _ = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        assert plane.limits[0, "a"] == 4000
        tree.gpus[0].containers["a"].memsize = 1000
        await trio.sleep(0.5 + 2 * PERIOD)
        assert plane.limits[0, "a"] == 1000
        nursery.cancel_scope.cancel()


async def test_meminfo_is_fed_once_per_change_and_backstop_stops_the_largest(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=1), FakePlane()
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
    assert plane.stopped == [((0, "a"), 10)]
    assert tree.gpus[0].containers["a"].procs == {11: 200, 12: 50}


async def test_a_meminfo_not_fed_is_fed_at_a_later_round_and_holds_up_no_other(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """The round feeds every changed meminfo in one worker call: one container's
    write that fails (its node gone a moment, say) neither stops the others' nor
    is forgotten."""
    tree, plane = two_containers(policy=1), FakePlane()
    for name in ("a", "b"):
        tree.gpus[0].containers[name].memsize = 1000
    plane.memory_by[0, "a"] = {10: 300}
    plane.memory_by[0, "b"] = {20: 400}
    feed = tree.feed_meminfo
    refusing = {"a"}

    def feed_or_refuse(gpu: int, name: str, procs: Mapping[int, int]) -> None:
        if name in refusing:
            raise OSError(5, "Input/output error")
        feed(gpu, name, procs)

    tree.feed_meminfo = feed_or_refuse  # type: ignore[method-assign]
    daemon, _ = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        await rounds(daemon, 2)
        assert tree.gpus[0].containers["b"].procs == {20: 400}
        assert tree.gpus[0].containers["a"].procs == {}
        refusing.clear()
        await rounds(daemon, 1)
        assert tree.gpus[0].containers["a"].procs == {10: 300}
        writes = len(tree.meminfo_writes)
        await rounds(daemon, 2)
        assert len(tree.meminfo_writes) == writes  # both fed: not written again
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("egpu", [False, True], ids=["cgpu", "egpu"])
async def test_a_lowered_limit_takes_nothing_away_unless_egpu(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, egpu: bool
) -> None:
    tree, plane = two_containers(policy=1), FakePlane()
    tree.gpus[0].containers["a"].memsize = 1000
    plane.memory_by[0, "a"] = {10: 600, 11: 300}
    if egpu:
        plane.egpu_keys.add((0, "a"))
    daemon, _ = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        await trio.sleep(0.5)
        tree.gpus[0].containers["a"].memsize = 500  # below the 900 it holds
        await trio.sleep(1)
        if egpu:
            assert plane.stopped == [((0, "a"), 10)], "eGPU: the operator asked for the stop"
        else:
            assert plane.stopped == [], "cGPU: what it held stays"
            plane.memory_by[0, "a"] = {10: 600, 11: 300, 12: 200}  # it grows: over again
            await trio.sleep(0.5)
            assert plane.stopped == [((0, "a"), 10)]
        nursery.cancel_scope.cancel()


async def test_state_survives_a_restart(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=2), FakePlane()
    first, _ = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        await trio.sleep(3)
        nursery.cancel_scope.cancel()
    saved = json.loads((tmp_path / STATE_NAME).read_text())
    assert set(saved["gpus"]["0"]["accounts"]) == {"a", "b"}
    again = FakePlane()
    second, _ = make_daemon(tree, again, tmp_path)
    await second.sync.read_all()  # what `run` does first
    assert again.restored[0] == saved["gpus"]["0"]


async def test_stale_or_broken_state_is_ignored(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=2), FakePlane()
    (tmp_path / STATE_NAME).write_text("{not json")
    daemon, _ = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        assert plane.restored == {}
        nursery.cancel_scope.cancel()


async def test_upgrade_saves_state_reexecs_and_the_new_daemon_writes_zero(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree, plane = two_containers(policy=2), FakePlane()
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
    assert first.lifecycle.upgrading
    assert not plane.closed  # a hot update does not touch the gates
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
        assert second.sync.restored == saved["gpus"]
        assert plane.restored[0] == saved["gpus"]["0"]
        nursery.cancel_scope.cancel()


async def test_upgrade_pings_the_watchdog_around_the_exec(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd's watchdog timer runs on through a hot update (same PID): the old
    daemon pings before it re-executes, the new one before its first interval
    (found by kmod/vm/node: a 3.5 s exec plus a 5 s interval missed a 10 s
    WatchdogSec)."""
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")  # pings every 5 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv(UPGRADED_ENV, raising=False)
    tree, plane = two_containers(policy=2), FakePlane()
    restarted = trio.Event()
    first, notifier = make_daemon(tree, plane, tmp_path, restart=restarted.set)
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        await trio.sleep(1)
        tree.upgrade = 1
        await restarted.wait()
        nursery.cancel_scope.cancel()
    assert notifier.sent[-1] == "WATCHDOG=1"  # the last word before the exec
    assert notifier.sent.count("WATCHDOG=1") == 1
    second, again = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(second.run)
        assert again.sent.index("WATCHDOG=1") < again.sent.index("READY=1")
        nursery.cancel_scope.cancel()


async def test_waits_for_the_tree_then_starts(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    tree, plane = two_containers(policy=1), FakePlane()
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
        # A tree that goes away later keeps the last view; the plane keeps scheduling.
        tree.fail = True
        await trio.sleep(1)
        assert not plane.closed
        assert 0 in plane.configs
        nursery.cancel_scope.cancel()


async def test_watchdog_pings_only_while_dispatchers_step(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    tree, plane = two_containers(policy=1), FakePlane()
    daemon, notifier = make_daemon(tree, plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        await trio.sleep(5.5)
        assert notifier.sent.count("WATCHDOG=1") == 5
        plane.stuck = True
        await trio.sleep(10)
        assert notifier.sent.count("WATCHDOG=1") == 5
        nursery.cancel_scope.cancel()


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Real time: poll until `predicate()` (the test's fail_after is the hang guard);
    print how long it took."""
    start = trio.current_time()
    while True:
        if predicate():
            break
        await trio.sleep(0.01)
    print(f"{what} after {trio.current_time() - start:.3f} s")


async def test_a_slow_stop_holds_up_nothing_else(tmp_path: Path) -> None:
    """Real threads, real time: an OOM script that does not end (until the test lets
    it) runs in a task and a worker of its own; meanwhile the tree is followed,
    meminfo is fed and the memory service goes on with its rounds."""
    tree, plane = two_containers(policy=1), FakePlane()
    tree.gpus[0].containers["a"].memsize = 1000
    plane.memory_by[0, "a"] = {10: 900, 11: 200}
    plane.stops_held = threading.Event()
    daemon, _ = make_daemon(tree, plane, tmp_path, inline=False)
    try:
        with trio.fail_after(60):  # a hang guard only
            async with trio.open_nursery() as nursery:
                await nursery.start(daemon.run)
                await until(lambda: plane.stops_begun == 1, "the stop under way")
                assert daemon.memory.stopping == {((0, "a"), 10)}
                tree.gpus[0].policy = 4
                plane.memory_by[0, "b"] = {20: 5}
                await until(lambda: plane.configs[0].policy is Policy.SOFT, "the tree followed")
                await until(lambda: tree.gpus[0].containers["b"].procs == {20: 5}, "meminfo fed")
                await rounds(daemon, 3)
                assert (plane.stopped, plane.stops_begun) == ([], 1), "one stop, still running"
                plane.stops_held.set()
                await until(lambda: plane.stopped == [((0, "a"), 10)], "the stop done")
                await rounds(daemon, 3)
                assert plane.stops_begun == 1, "stopped once, not again meanwhile"
                nursery.cancel_scope.cancel()
    finally:
        plane.stops_held.set()


async def test_a_wedged_tree_holds_up_nothing_else_nor_the_exit(tmp_path: Path) -> None:
    """Real threads, real time: the control tree stops answering (a wedged FUSE
    mount). Its calls are abandoned after the call deadline; meanwhile the backstop
    stops a process over its limit and snapshots are published; on exit the gates
    open, whatever the tree's thread is doing (it stays wedged: an exit that waited
    for it would never come)."""
    tree, plane = two_containers(policy=1), FakePlane()
    tree.gpus[0].containers["a"].memsize = 1000
    published: list[float] = []
    settings = Settings(period=0.05, memory_interval=0.1, publish_interval=0.1,
                        call_deadline=0.5)
    daemon, notifier = make_daemon(tree, plane, tmp_path, inline=False, settings=settings,
                                   publish=lambda snapshot: published.append(snapshot.timestamp))
    try:
        with trio.fail_after(60):  # a hang guard only
            async with trio.open_nursery() as nursery:
                await nursery.start(daemon.run)
                tree.wedge()
                tree.gpus[0].policy = 4  # the daemon cannot see it, and must not wait for it
                await rounds(daemon, 3)
                plane.memory_by[0, "a"] = {10: 900, 11: 200}
                before = len(published)
                await until(lambda: plane.stopped == [((0, "a"), 10)], "stopped")
                await until(lambda: len(published) >= before + 5, "published 5 snapshots")
                assert plane.configs[0].policy is Policy.PREEMPTIVE
                exiting = trio.current_time()
                nursery.cancel_scope.cancel()
        print(f"exited {trio.current_time() - exiting:.3f} s after the cancel")
        assert plane.closed, "every gate opens on the way out"
        assert "STOPPING=1" in notifier.sent
    finally:
        tree.wedge(False)


async def test_signals_hup_reloads_and_term_fails_open(tmp_path: Path) -> None:
    """Real signals, real time (short)."""
    tree, plane = two_containers(policy=1), FakePlane()
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
    assert plane.closed
    assert notifier.sent[-1] == "STOPPING=1"
    assert (tmp_path / STATE_NAME).exists()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="period must be a positive number"):
        Settings(period=0)
    with pytest.raises(ValueError, match="slice must be a positive number"):
        Settings(slice=float("nan"))
    for priority in (-1, 100, 1.0, True):
        with pytest.raises(ValueError, match=r"dispatch_priority must be 0 .* 1-99, not"):
            Settings(dispatch_priority=priority)  # type: ignore[arg-type]


async def rounds(daemon: Daemon, count: int) -> None:
    """Wait until the memory service has done `count` more rounds."""
    for _ in range(count):
        await daemon.memory.round_done.wait()


@pytest.mark.parametrize(("policy", "settings", "stopped"), [
    (1, {}, {10}),
    (3, {}, {10}),
    (5, {}, set()),  # memory only: bypassing stays a memory matter
    (1, {"on_bypass": "report"}, set()),
    (1, {"report_bypass": frozenset({"a"})}, set()),
], ids=["policy1", "policy3", "policy5", "report-node", "report-container"])
async def test_a_process_without_libcgpu_is_stopped_in_the_round_that_sees_it(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, policy: int,
    settings: dict[str, Any], stopped: set[int], caplog: pytest.LogCaptureFixture
) -> None:
    """Pid 10 holds GPU memory with no process slot (it bypassed libcgpu); pid 11 has one.
    Only 10 is stopped, without the OOM script, once, and counted for the snapshot; unless
    the GPU is memory-only or the operator asked for reports."""
    tree, plane = two_containers(policy=policy), FakePlane()
    plane.memory_by[0, "a"] = {10: 100, 11: 200}
    plane.unmanaged[0, "a"] = {10}
    plane.egpu_keys.add((0, "a"))
    daemon, _ = make_daemon(tree, plane, tmp_path, settings=Settings(
        period=PERIOD, tree_refresh=0.5, memory_interval=0.1, publish_interval=0.5,
        **settings))
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        await rounds(daemon, 3)
        nursery.cancel_scope.cancel()
    assert plane.stopped == [((0, "a"), pid) for pid in sorted(stopped)]
    assert plane.stopped_with_script == [False] * len(stopped), "eGPU, but no OOM script"
    assert daemon.memory.bypass_stopped == ({(0, "a"): 1} if stopped else {})
    assert daemon.memory.stopped == {}, "not a memory stop"
    figures = daemon.publisher.snapshot().container(0, "a")
    assert figures is not None
    assert figures.bypass_stops == len(stopped)
    logged = [r.getMessage() for r in caplog.records if "without libcgpu" in r.getMessage()]
    if policy == 5:
        assert logged == []
    else:
        assert len(logged) == 1, logged  # once, however many rounds see it
        assert logged[0].endswith("stopping it" if stopped else "reported only")


def test_on_bypass_takes_stop_or_report() -> None:
    with pytest.raises(ValueError, match="on_bypass must be stop or report"):
        Settings(on_bypass="kill")


class MovingPlane(FakePlane):
    """A plane whose dispatchers charge container a one more second at every look."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def figures(self) -> dict[int, Figures]:
        self.looks += 1
        self.used[0] = {"a": float(self.looks)}
        return super().figures()


async def test_a_snapshot_is_of_one_instant_of_the_dispatchers(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """The GPU time, the shares and the holder of a snapshot come from one look at the
    dispatchers, however often they move meanwhile."""
    plane = MovingPlane()
    daemon, _ = make_daemon(two_containers(policy=1), plane, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        await rounds(daemon, 2)
        nursery.cancel_scope.cancel()
    before = plane.looks
    figures = daemon.publisher.snapshot().container(0, "a")
    assert plane.looks == before + 1
    assert figures is not None
    assert figures.gpu_time_seconds == before + 1
