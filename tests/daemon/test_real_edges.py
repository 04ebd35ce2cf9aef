"""The daemon's real edges: the FUSE tree with inotify (changes act at once), the regions
driven by a dispatcher thread, stopping a process, NVML's memory."""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from cgpu_km.daemon.context import Settings
from cgpu_km.daemon.core import Daemon
from cgpu_km.dataplane import futex
from cgpu_km.dataplane import region as region_mod
from cgpu_km.dataplane.attribution import Nvml
from cgpu_km.dataplane.dispatch import ANSWER_LOOKS, RegionPort
from cgpu_km.dataplane.plane import RegionPlane
from cgpu_km.dataplane.stopping import stop_process
from cgpu_km.sched import ContainerSpec, GpuConfig, IdleWatch, Policy
from cgpu_km.tree import client as treefs
from cgpu_km.tree.fstree import FsTree
from cgpu_km.tree.views import CONTAINER_NODES, LOST, Change
from cgpu_km.tree.watch import InotifyWatcher
from tests.daemon.fakes import FakePlane, forged_region


def echo(root: Path, relpath: str, value: object) -> None:
    (root / relpath).write_text(f"{value}\n")


async def wait_until(predicate: Callable[[], bool]) -> float:
    """Seconds until `predicate()` holds (checked every 5 ms); a hang guard fails it
    after 30 s, half the tests' 60 s poll, so a pass means the watcher saw it."""
    start = trio.current_time()
    while not predicate():
        if trio.current_time() - start > 30:
            raise AssertionError("condition not reached within 30 s")
        await trio.sleep(0.005)
    return trio.current_time() - start


async def test_echo_acts_through_inotify(
    control_tree: Path, tmp_path: Path
) -> None:
    treefs.inst_ctl(control_tree, "add 0 a weight=1 memsize=4096")
    plane = FakePlane()
    settings = Settings(period=0.05, tree_refresh=60, full_refresh=60)
    daemon = Daemon(FsTree(control_tree), plane, state_dir=tmp_path, settings=settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        assert daemon.sync.watcher is not None
        await trio.to_thread.run_sync(echo, control_tree, "0/policy", 2)
        took = await wait_until(lambda: plane.configs[0].policy is Policy.WEIGHTED)
        print(f"the policy reached the plane {took * 1000:.1f} ms after the echo")
        await trio.to_thread.run_sync(echo, control_tree, "0/a/weight", 5)
        await wait_until(lambda: plane.configs[0].containers["a"].weight == 5)
        await trio.to_thread.run_sync(echo, control_tree, "0/a/memsize", 2048)
        await wait_until(lambda: plane.limits[0, "a"] == 2048)
        await trio.to_thread.run_sync(treefs.inst_ctl, control_tree, "add 1 b highprio=1")
        await wait_until(lambda: 1 in plane.configs and "b" in plane.configs[1].containers)
        assert plane.configs[1].containers["b"].highprio
        await trio.to_thread.run_sync(treefs.inst_ctl, control_tree, "del b")
        await wait_until(lambda: "b" not in plane.configs[1].containers)
        nursery.cancel_scope.cancel()


def test_watcher_names_what_was_written(control_tree: Path) -> None:
    treefs.inst_ctl(control_tree, "add 0 a")
    watcher = InotifyWatcher(control_tree)
    try:
        view = FsTree(control_tree).read_quick()
        watcher.sync(view.gpus)
        echo(control_tree, "0/a/util_limit", 30)
        echo(control_tree, "1/prio_ratio", 50)
        # The kernel queues an inotify event before the write returns: waiting for
        # the watcher's fd to be readable is waiting for that event, not for a time.
        assert select.select([watcher], [], [], 10)[0]
        assert set(watcher.changes()) == {Change(0, "a"), Change(1)}
        treefs.inst_ctl(control_tree, "add 1 z")
        assert select.select([watcher], [], [], 10)[0]
        assert watcher.changes() == [Change(node="inst_ctl")]
        assert watcher.changes() == []
    finally:
        watcher.close()



def test_watcher_says_so_when_the_kernel_dropped_events(tmp_path: Path) -> None:
    """More writes than the inotify queue holds, none read: the kernel drops the
    rest and queues an overflow, which the watcher reports as LOST (the daemon
    then reads everything), not as nothing."""
    for node in ("upgrade", "inst_ctl"):
        (tmp_path / node).write_text("0\n")
    watcher = InotifyWatcher(tmp_path)
    queue = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    files = [os.open(tmp_path / node, os.O_WRONLY) for node in ("upgrade", "inst_ctl")]
    try:
        for i in range(queue + 2):  # alternating: the kernel merges only repeats
            os.write(files[i % 2], b"0")
        changes = watcher.changes()
        assert LOST in changes
        assert Change(node="upgrade") in changes  # what was queued before is kept
    finally:
        for fd in files:
            os.close(fd)
        watcher.close()


def test_a_sync_watches_the_root_nodes_anew(tmp_path: Path) -> None:
    """A remounted tree's watches went with the old mount (as a replaced file's
    do): the next `sync` watches `inst_ctl` and `upgrade` again, not only the GPUs
    and containers, so a registration after the remount is seen at once."""
    for node in ("upgrade", "inst_ctl"):
        (tmp_path / node).write_text("0\n")
    watcher = InotifyWatcher(tmp_path)
    try:
        staged = tmp_path / ".replacement"
        staged.write_text("0\n")
        os.replace(staged, tmp_path / "inst_ctl")  # its watch ends (IN_IGNORED)
        assert select.select([watcher], [], [], 10)[0]
        watcher.changes()
        watcher.sync({})
        (tmp_path / "inst_ctl").write_text("add 0 a\n")
        assert select.select([watcher], [], [], 10)[0]
        assert Change(node="inst_ctl") in watcher.changes()
    finally:
        watcher.close()


def test_watcher_sees_a_write_into_a_replaced_file_before_it_syncs(plain_tree: Path) -> None:
    """The mount-free tree replaces a node's file by a rename, which ends the
    file's watch; a write into the new file before the next `sync` still names
    its container (the directory's watch takes it)."""
    treefs.inst_ctl(plain_tree, "add 0 a weight=1")
    for node in CONTAINER_NODES:  # the server has rendered the whole container
        wait_for_file(plain_tree / "0" / "a" / node)
    watcher = InotifyWatcher(plain_tree)
    try:
        watcher.sync(FsTree(plain_tree).read_quick().gpus)
        weight = plain_tree / "0" / "a" / "weight"
        staged = plain_tree / "0" / "a" / ".replacement"
        staged.write_text("1\n")
        os.replace(staged, weight)  # as the tree's server renders a value
        assert select.select([watcher], [], [], 10)[0]
        assert Change(0, "a") in watcher.changes()
        weight.write_text("3\n")  # no sync yet: no watch on the new file
        assert select.select([watcher], [], [], 10)[0]
        assert Change(0, "a") in watcher.changes()
    finally:
        watcher.close()

def test_region_plane_dispatches_on_real_regions(tmp_path: Path) -> None:
    """A dispatcher thread per GPU: heartbeat, a grant to the one that waits
    (as libcgpu says it does), live limits, gates open when the plane closes."""
    for name, host in (("a", 0), ("b", 1)):
        region_mod.Region.create(region_mod.region_path(name, tmp_path), name,
                                 [region_mod.GpuSpec(0, "", host, 0)]).close()
    plane = RegionPlane(tmp_path, nvml=None)
    plane.attach({0: {"a", "missing"}, 1: {"b"}})
    assert plane.missing() == {"missing", "a", "b"}, "no identity recorded yet either"
    one = GpuConfig(policy=Policy.PREEMPTIVE, containers={"a": ContainerSpec(1)})
    plane.schedule(0, one, None)
    try:
        with region_mod.Region.open(region_mod.region_path("a", tmp_path)) as a:
            deadline = time.monotonic() + 30  # a hang guard only
            while a.heartbeat_ns < time.monotonic_ns() - 500_000_000:
                assert time.monotonic() < deadline, "no heartbeat"
                time.sleep(0.01)
            seen = a.heartbeat_ns  # the dispatcher stamps it every round: wait for one more
            while a.heartbeat_ns == seen:
                assert time.monotonic() < deadline, "no second heartbeat"
                time.sleep(0.01)
            assert not a.gate_is_open(0), "nobody waits: nobody is granted"
            slot = a._account.proc[0]  # a process waits at the gate, as libcgpu writes it
            slot.state, slot.pid, a._account.slots_used = region_mod.SLOT_LIVE, 1, 1
            slot.gpu[0].pending = 1
            a._account.doorbell[0] += 1
            futex.wake_all(a.doorbell_address(0))
            while not a.gate_is_open(0):
                assert time.monotonic() < deadline, "the waiting container was not granted"
                time.sleep(0.001)
            plane.set_limit((0, "a"), 12345)
            assert a.limit(0) == 12345
            assert plane.figures()[0].holder == "a"
            # ticking: every dispatcher stepped since `since` (each counted a step after it)
            since = time.monotonic()
            steps = {gpu: f.steps for gpu, f in plane.figures().items()}
            while any(f.steps == steps[gpu] for gpu, f in plane.figures().items()):
                assert time.monotonic() < deadline, "the dispatcher stopped stepping"
                time.sleep(0.001)
            assert plane.ticking(within=time.monotonic() - since)
    finally:
        plane.close()
    with region_mod.Region.open(region_mod.region_path("a", tmp_path)) as a:
        assert a.gate_is_open(0), "fail open on the way out"
    with region_mod.Region.open(region_mod.region_path("b", tmp_path)) as b:
        assert b.gate_is_open(0), "also the gates no dispatcher drove"
    # A replaced region (container restarted) is reopened on the next attach.
    region_mod.Region.create(region_mod.region_path("a", tmp_path), "a",
                             [region_mod.GpuSpec(0, "", 0, 0)]).close()
    assert plane.attach({0: {"a"}})
    assert not plane.attach({0: {"a"}}), "nothing changed the second time"


def test_a_watched_holder_says_when_it_goes_idle(tmp_path: Path) -> None:
    """The port never looks at a busy holder: it asks the holder's processes
    (the region's idle_grace_ns, while its gate is open) to say when they go
    idle. Until one does, the holder is busy at every observation; its report
    (idle_ns, then a ring, as libcgpu's watcher writes them) wakes the wait,
    and the next observation says it is idle, since when."""
    region_mod.Region.create(region_mod.region_path("a", tmp_path), "a",
                             [region_mod.GpuSpec(0, "", 0, 0)]).close()
    with region_mod.Region.open(region_mod.region_path("a", tmp_path)) as a:
        port = RegionPort(0)
        port.set_entries({"a": (a, 0)})
        slot = a._account.proc[0]  # a process of a that has launched, as libcgpu says
        slot.state, slot.pid, a._account.slots_used = region_mod.SLOT_LIVE, 1, 1
        slot.gpu[0].watching, slot.gpu[0].launches = 1, 7
        assert port.observe()["a"].active_at is None, "not watched yet"
        now = time.monotonic()
        port.apply(frozenset({"a"}), time.monotonic_ns(),
                   watch=IdleWatch("a", at=now + 0.002, grace=0.002, otherwise=now + 60))
        assert a._control.gpu[0].idle_grace_ns == 2_000_000
        busy = port.observe()["a"]
        assert (busy.idle, busy.active_at is not None) == (False, True), "busy: active now"
        woken: list[str | None] = []
        waiter = threading.Thread(target=lambda: woken.append(
            port.wait(int((now + 60) * 1e9), set(), "a")))
        waiter.start()
        assert parked(waiter), "a busy holder: no look, no step"
        went_idle = time.monotonic_ns() - 3_000_000
        slot.gpu[0].idle_ns = went_idle
        a._account.doorbell[0] += 1
        futex.wake_all(a.doorbell_address(0))
        waiter.join(30)  # a hang guard only
        assert woken == ["a"], "its ring woke the wait"
        seen = port.observe()["a"]
        assert seen.idle
        assert seen.active_at == went_idle / 1e9
        port.apply(frozenset(), time.monotonic_ns())
        assert a._control.gpu[0].idle_grace_ns == 0, "closed: nobody asks"
        assert not port.observe()["a"].idle, "nor reads its report"


FUTEX_WAITV = 449


def parked(thread: threading.Thread) -> bool:
    """Wait until `thread` sleeps in futex_waitv (as /proc shows it); False once
    it has ended instead."""
    syscall = Path(f"/proc/self/task/{thread.native_id}/syscall")
    deadline = time.monotonic() + 30  # a hang guard only
    while thread.is_alive():
        with contextlib.suppress(OSError):
            if syscall.read_text().split()[:1] == [str(FUTEX_WAITV)]:
                return True
        assert time.monotonic() < deadline, "the wait never went to sleep"
        time.sleep(0.005)
    return False


def test_the_port_wakes_its_dispatcher_once_every_drain_answer_came(tmp_path: Path) -> None:
    """While a holder drains, each of its processes rings as it answers; only the
    ring that completes the answers wakes the dispatcher (the others are a look
    at the holder's slots, not a step over every container). A holder that rings
    without answering wakes it all the same, at the ANSWER_LOOKS-th ring of one
    wait: it cannot keep it asleep."""
    with forged_region(tmp_path, "a", 2) as (a, slots):
        port = RegionPort(0)
        port.set_entries({"a": (a, 0)})
        for slot in slots:
            slot.gpu[0].watching = 1
        woken: list[str | None] = []

        def closed_and_waiting() -> threading.Thread:
            a.set_gate(0, True)
            a.set_gate(0, False)  # a close: each watching process answers it
            assert not port.observe()["a"].answered
            waiter = threading.Thread(target=lambda: woken.append(port.wait(
                int((time.monotonic() + 60) * 1e9), set(), "a", answers_of="a")))
            waiter.start()
            return waiter

        def ring(slot: region_mod.ProcSlot | None = None) -> None:
            if slot is not None:
                slot.gpu[0].drained_seq = a.close_seq(0)
            a._account.doorbell[0] += 1
            futex.wake_all(a.doorbell_address(0))

        waiter = closed_and_waiting()
        assert parked(waiter)
        ring(slots[0])
        assert parked(waiter), "one answer of two: no step yet"
        ring(slots[1])
        waiter.join(30)  # a hang guard only
        assert woken == ["a"], "the last answer wakes the dispatcher"
        assert port.observe()["a"].answered

        waiter = closed_and_waiting()
        rings = 0
        while parked(waiter) and rings < 10 * ANSWER_LOOKS:
            ring()
            rings += 1
        waiter.join(30)
        assert not waiter.is_alive(), "woken by the rings, not by the deadline"
        # Not at the first ring, either (unless a ring came between a look and
        # the next wait, which wakes it at once: then no ringer is named).
        assert rings >= ANSWER_LOOKS - 1 or woken[-1] is None
        assert not port.observe()["a"].answered


@pytest.mark.parametrize("control_tree", [2], indirect=True)
def test_fstree_reads_what_echo_wrote(control_tree: Path) -> None:
    treefs.inst_ctl(control_tree, "add 1 c memsize=4096 weight=3 util_limit=20")
    tree = FsTree(control_tree)
    quick = tree.read_quick(version=True)
    assert quick.version
    assert quick.gpus[1].containers == {"c"}
    nodes = tree.read_container(1, "c")
    assert (nodes.memsize, nodes.weight, nodes.util_limit, nodes.highprio) == (4096, 3, 20, 0)
    tree.feed_meminfo(1, "c", {77: 1000})
    assert "PID: 77 Mem: 1000" in (control_tree / "1" / "c" / "meminfo").read_text()
    with pytest.raises(FileNotFoundError):
        tree.read_container(0, "c")


@pytest.fixture
def plain_tree(tmp_path: Path) -> Iterator[Path]:
    """The mount-free tree (`cgpu_km.tree.plain`): node files replaced by rename."""
    root = tmp_path / "plain"
    process = subprocess.Popen([sys.executable, "-m", "cgpu_km.tree.plain", "--root", str(root),
                                "--gpus", "2"], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while not (root / "inst_ctl").exists():
            assert process.poll() is None, "plaintree exited"
            assert time.monotonic() < deadline, "plaintree did not start"
            time.sleep(0.02)
        yield root
    finally:
        process.terminate()
        process.wait(timeout=10)


async def test_plain_tree_changes_act_quickly_too(plain_tree: Path, tmp_path: Path) -> None:
    await trio.to_thread.run_sync(treefs.inst_ctl, plain_tree, "add 0 a weight=1")
    await trio.to_thread.run_sync(wait_for_file, plain_tree / "0" / "a" / "weight")
    plane = FakePlane()
    settings = Settings(period=0.05, tree_refresh=60, full_refresh=60)
    daemon = Daemon(FsTree(plain_tree), plane, state_dir=tmp_path, settings=settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        for value in (2, 3, 0):  # each write replaces the file: the watch must follow
            await trio.to_thread.run_sync(echo, plain_tree, "0/policy", value)
            await wait_until(lambda v=value: plane.configs[0].policy == v)  # type: ignore[misc]
        await trio.to_thread.run_sync(echo, plain_tree, "0/a/weight", 4)
        await wait_until(lambda: plane.configs[0].containers["a"].weight == 4)
        await trio.to_thread.run_sync(treefs.inst_ctl, plain_tree, "add 0 b")
        await wait_until(lambda: "b" in plane.configs[0].containers)
        nursery.cancel_scope.cancel()


def wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + 5
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def test_a_stop_without_a_script_kills_and_a_gone_process_is_no_error() -> None:
    victim = subprocess.Popen(["sleep", "60"])
    try:
        stop_process(victim.pid)
        assert victim.wait(timeout=5) == -9
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    stop_process(victim.pid)  # already gone: nothing to do, no error


def test_hot_update_keeps_the_pid_and_writes_zero(control_tree: Path, tmp_path: Path) -> None:
    """The real daemon: `echo 1 > upgrade` re-executes it in place; upgrade reads 0 again."""
    log = tmp_path / "daemon.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "cgpu-daemon"), "--root", str(control_tree),
             "--state-dir", str(tmp_path / "state"), "--region-dir", str(tmp_path / "regions")],
            stdout=out, stderr=out,
        )
    try:
        deadline = time.monotonic() + 30
        while "running:" not in log.read_text():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        echo(control_tree, "upgrade", 1)
        while "hot update done" not in log.read_text() or log.read_text().count("running:") < 2:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert (control_tree / "upgrade").read_text() == "0\n"
        assert log.read_text().count("running:") == 2  # the same process, started again
        assert (tmp_path / "state" / "daemon-state.json").exists()
    finally:
        process.terminate()
        process.wait(timeout=30)


class FakeNvml:
    """Just enough of pynvml for `Nvml.memory_by_pid`."""

    class NVMLError(Exception):
        pass

    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list[object]:
        return [SimpleNamespace(pid=7, usedGpuMemory=100), SimpleNamespace(pid=8,
                                                                           usedGpuMemory=None)]

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> object:
        raise self.NVMLError("not supported")


def test_nvml_memory_failures_are_unknowns() -> None:
    nvml = Nvml.__new__(Nvml)
    nvml.nvml, nvml.handles = FakeNvml(), {0: object()}
    procs, used = nvml.memory_by_pid()
    assert procs == {(0, 7): 100, (0, 8): 0}
    assert used == {}  # the failing field is unknown, not an error
