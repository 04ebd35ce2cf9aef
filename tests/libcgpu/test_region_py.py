"""cgpu_km.dataplane.region on its own: creation, modes, validation, gates, closes,
heartbeat, views."""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgpu_km.dataplane import futex
from cgpu_km.dataplane import region as region_mod
from cgpu_km.dataplane.region import GpuSpec, Region, RegionError
from tests.libcgpu.sandbox import local_alive, start_time, wait_in_syscall


def make(tmp_path: Path, **kw: object) -> Region:
    gpus = kw.pop("gpus", [GpuSpec(1 << 30, "GPU-a", 2, 5), GpuSpec(2 << 30, "GPU-b", 3)])
    return Region.create(tmp_path / "regions" / "c1", "ctr1", gpus, **kw)  # type: ignore[arg-type]


def test_create_and_reopen(tmp_path: Path) -> None:
    with make(tmp_path, mode="egpu", oom_script="/bin/oom", gate_timeout_ns=7) as r:
        assert (r.container_id, r.mode, r.oom_script, r.ngpus) == ("ctr1", "egpu", "/bin/oom", 2)
        assert r.gate_timeout_ns == 7
        r.set_limit(1, 123)
    path = tmp_path / "regions" / "c1"
    with Region.open(path) as r:
        assert r.gpu_spec(0) == GpuSpec(1 << 30, "GPU-a", 2, 5)
        assert r.gpu_spec(1) == GpuSpec(123, "GPU-b", 3, region_mod.CTX_MEASURE)
        assert r.gpu_for_host(3) == 1
        assert r.gpu_for_host(0) is None
        assert r.processes() == []
        assert r.usage(0) == 0
    assert sorted(p.name for p in path.parent.iterdir()) == ["c1"], "no staging left behind"


def create_side_by_side(folder: Path, count: int) -> list[BaseException]:
    """`count` threads create a region each in `folder` at once; what they raised."""
    start = threading.Barrier(count)
    errors: list[BaseException] = []

    def create(k: int) -> None:
        start.wait()
        try:
            Region.create(folder / f"c{k}", f"ctr{k}", [GpuSpec(1 << 30, "GPU-a", 0)]).close()
        except BaseException as error:  # reported by the caller
            errors.append(error)

    threads = [threading.Thread(target=create, args=(k,)) for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_jobs_started_side_by_side_create_the_folder_once(tmp_path: Path) -> None:
    """Containers start together: the first regions race to create their folder."""
    for attempt in range(20):
        folder = tmp_path / f"regions{attempt}"
        assert create_side_by_side(folder, 8) == []
        assert sorted(p.name for p in folder.iterdir()) == [f"c{k}" for k in range(8)]


def test_files_only_root_can_reach(tmp_path: Path) -> None:
    """The folder is root's alone; the container gets the files through bind
    mounts: the control part read-only to anyone but root, the account part
    writable by the container's processes of any user."""
    make(tmp_path).close()
    path = tmp_path / "regions" / "c1"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}
    assert modes == {"control": 0o644, "account": 0o666}
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert {p.stat().st_uid for p in [path, *path.iterdir()]} == {os.getuid()}


def test_gates_start_closed_and_held_until_a_daemon_grants(tmp_path: Path) -> None:
    before = time.monotonic_ns()
    with make(tmp_path) as held:
        assert [held.gate_is_open(k) for k in range(2)] == [False, False]
        assert held.heartbeat_ns >= before, "held for the gate timeout, waiting for a daemon"
    with make(tmp_path, gates_open=True) as free:
        assert [free.gate_is_open(k) for k in range(2)] == [True, True]
        assert free.heartbeat_ns == 0


@pytest.mark.parametrize(("kw", "message"), [
    ({"gpus": []}, "1 to 16 GPUs"),
    ({"gpus": [GpuSpec(1)] * 17}, "1 to 16 GPUs"),
    ({"mode": "vgpu"}, "mode must be"),
    ({"gate_timeout_ns": 0}, "must be positive"),
    ({"gpus": [GpuSpec(-1)]}, "must not be negative"),
    ({"oom_script": "x" * 300}, "OOM script path is longer"),
    ({"gpus": [GpuSpec(1, "u" * 100)]}, "GPU UUID is longer"),
], ids=["no-gpus", "too-many", "mode", "timeout", "negative", "script", "uuid"])
def test_bad_input_is_refused_and_writes_nothing(tmp_path: Path, kw: dict[str, object],
                                                 message: str) -> None:
    with pytest.raises(RegionError, match=message):
        make(tmp_path, **kw)
    assert not (tmp_path / "regions").exists() or list((tmp_path / "regions").iterdir()) == []


def test_open_refuses_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(RegionError, match="cannot open"):
        Region.open(tmp_path / "missing")
    small = tmp_path / "small"
    small.mkdir()
    (small / "control").write_bytes(b"x" * 100)
    (small / "account").write_bytes(b"x" * 100)
    with pytest.raises(RegionError, match="too small"):
        Region.open(small)
    zeros = tmp_path / "zeros"
    zeros.mkdir()
    (zeros / "control").write_bytes(bytes(region_mod.CONTROL_SIZE))
    (zeros / "account").write_bytes(bytes(region_mod.ACCOUNT_SIZE))
    with pytest.raises(RegionError, match="unknown layout"):
        Region.open(zeros)


def test_unknown_gpu_and_bad_values(tmp_path: Path) -> None:
    with make(tmp_path) as r:
        with pytest.raises(RegionError, match="GPU 2 is not in region"):
            r.limit(2)
        with pytest.raises(RegionError):
            r.set_limit(0, -1)
        assert r.limit(0) == 1 << 30


@pytest.mark.parametrize("word", ["gate", "changes"])
def test_a_grant_wakes_a_futex_waiter(tmp_path: Path, word: str) -> None:
    """set_gate(open) wakes a thread blocked in FUTEX_WAIT on the gate word (as
    libcgpu slept before), or on the low half of its count of changes (as it
    sleeps now: a gate that opened and closed again changed the count, so no
    grant is lost between a waiter's look at the gate and its sleep)."""
    with make(tmp_path) as r:
        assert not r.gate_is_open(1)
        r.set_gate(1, True)
        r.set_gate(1, False)  # the count is past zero: the waiter must read it
        address = r._gate_address(1)
        expected = region_mod.GATE_CLOSED
        if word == "changes":
            address = r._gate_changes_address(1)
            expected = ctypes.c_uint32.from_address(address).value
            assert expected == 2
        libc = ctypes.CDLL(None, use_errno=True)

        def sleep() -> int:
            timeout = (ctypes.c_long * 2)(10, 0)
            return int(libc.syscall(ctypes.c_long(futex._SYS_FUTEX),
                                    ctypes.c_void_p(address), ctypes.c_int(0),
                                    ctypes.c_int(expected), timeout, None, ctypes.c_int(0)))

        # 0: woken (its own 10 s timeout would give -1, ETIMEDOUT)
        assert woken(sleep, futex._SYS_FUTEX, "FUTEX_WAIT on the gate",
                     lambda: r.set_gate(1, True, 1234)) == 0
        assert r.gate_is_open(1)
        assert r.grant_ns(1) == 1234


def woken(sleep: Callable[[], int], syscall: int, what: str, action: Callable[[], None]) -> int:
    """Run `sleep` in a thread until it blocks in `syscall` (`what`), then
    `action`; what `sleep` returned."""
    tids: list[int] = []
    woke: list[tuple[float, int]] = []

    def run() -> None:
        tids.append(threading.get_native_id())
        woke.append((time.monotonic(), sleep()))

    thread = threading.Thread(target=run)
    thread.start()
    while not tids:
        time.sleep(0.001)
    wait_in_syscall(os.getpid(), tids[0], syscall, what, running=thread.is_alive)
    acted = time.monotonic()
    action()
    thread.join(timeout=30)
    assert woke, f"{what}: still asleep 30 s after"
    print(f"{what}: returned {woke[0][1]} {woke[0][0] - acted:.4f} s after")
    return woke[0][1]


def watcher_woken(r: Region, action: Callable[[], None], what: str) -> bool:
    """Whether `action` wakes a thread that sleeps on the control's wake word (as
    libcgpu's watcher does) in futex_waitv; its own deadline is 10 s away."""
    wake = r._control.wake
    address = ctypes.addressof(r._control) + region_mod.ControlLayout.wake.offset
    index = woken(lambda: futex.wait_any([(address, wake, True)], time.monotonic_ns() + 10**10),
                  futex._SYS_FUTEX_WAITV, f"futex_waitv on wake ({what})", action)
    return index == 0  # the word woke it; its deadline gives -1


def test_a_close_bumps_close_seq_and_wakes_watchers(tmp_path: Path) -> None:
    with make(tmp_path, gates_open=True) as r:
        wake = r._control.wake
        r.set_gate(0, True)  # no change: no close
        assert (r.close_seq(0), r._control.wake) == (0, wake)
        assert watcher_woken(r, lambda: r.set_gate(0, False), "the close")
        assert r.close_seq(0) == 1
        assert r.close_seq(1) == 0
        assert r.grant_ns(0) == 0


def test_a_grant_to_a_watched_holder_wakes_its_watchers(tmp_path: Path) -> None:
    """The dispatcher asks a holder to watch (idle_grace_ns) before it opens the
    gate: a watcher that woke for the ask found the gate closed and slept again,
    and its process's launches do not wake it, so the grant must, else no idle
    report comes until the watcher's own look a second later. A grant nobody
    asked to watch wakes no watcher. The ask (or the slice's end) before the
    grant wakes nobody: the grant does, once for both."""
    with make(tmp_path) as r:
        wake = r._control.wake
        r.set_gate(1, True)
        assert r._control.wake == wake, "nobody asked: no wake"
        r.set_idle_grace(0, 2_000_000)
        r.set_close_at(0, time.monotonic_ns() + 20_000_000)
        assert r._control.wake == wake, "asked while closed: the grant wakes them"
        assert watcher_woken(r, lambda: r.set_gate(0, True), "the grant")
        assert r.gate_is_open(0)
        assert r._control.wake == wake + 1, "once"
        r.set_idle_grace(1, 2_000_000)
        assert r._control.wake == wake + 2, "asked while open: at once"
        r.set_close_at(1, time.monotonic_ns() + 20_000_000)
        assert r._control.wake == wake + 3, "told while open: at once"


def test_heartbeat(tmp_path: Path) -> None:
    with make(tmp_path) as r:
        before = time.monotonic_ns()
        r.heartbeat()
        assert before <= r.heartbeat_ns <= time.monotonic_ns()
        r.heartbeat(42)
        assert r.heartbeat_ns == 42


def fill_slot(r: Region, index: int, pid: int, started: int, mem: int) -> None:
    """Write a slot as libcgpu would (for tests of the daemon's view)."""
    slot = r._account.proc[index]
    slot.pid = pid
    slot.start_time = started
    slot.pidns = 0
    slot.gpu[0].mem = mem
    slot.gpu[0].launches = 3
    slot.state = region_mod.SLOT_LIVE
    r._account.slots_used = max(r._account.slots_used, index + 1)


def test_views_and_reclaim(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = start_time(sleeper.pid)
        assert start is not None
        with make(tmp_path) as r:
            fill_slot(r, 0, os.getpid(), start_time(os.getpid()) or 0, 100)
            fill_slot(r, 1, sleeper.pid, start, 20)
            fill_slot(r, 2, sleeper.pid, start + 1, 3)  # pid reused: not the same process
            assert r.usage(0) == 123
            assert r.activity(0).launches == 9
            assert sorted(p.pid for p in r.processes()) == sorted([os.getpid(), *[sleeper.pid] * 2])
            assert r.slot_figures(0).identities == {(p.pidns, p.pid, p.start_time)
                                                    for p in r.processes()}
            r._account.proc[1].gpu[0].gate_wait_ns, r._account.proc[1].gpu[0].oom_refusals = 7, 2
            r._account.proc[2].gpu[0].gate_wait_ns = 5
            figures = r.slot_figures(0)
            assert (figures.gate_wait_ns, figures.oom_refusals) == (12, 2), (
                "as the views sum them")
            assert r.reclaim(local_alive) == [sleeper.pid]  # the slot with the wrong start time
            assert r.usage(0) == 120
            figures = r.slot_figures(0)
            assert (figures.gate_wait_ns, figures.oom_refusals) == (7, 2), (
                "a freed slot counts no more")
            sleeper.kill()
            sleeper.wait()
            assert r.reclaim(local_alive) == [sleeper.pid]
            assert r.usage(0) == 100
            assert r.reclaim(lambda view: False) == [os.getpid()]
            assert r.usage(0) == 0
            assert r.processes() == []
    finally:
        sleeper.kill()
        sleeper.wait()


def test_failed_open_is_the_latest_record_of_a_live_slot(tmp_path: Path) -> None:
    with make(tmp_path) as r:
        assert r.failed_open(0) is None
        fill_slot(r, 0, 1, 1, 0)
        fill_slot(r, 1, 2, 1, 0)
        fill_slot(r, 2, 3, 1, 0)
        for index, (stale, wake, went) in enumerate([(10, 30, 31), (40, 60, 62), (70, 90, 93)]):
            line = r._account.proc[index].gpu[0]
            line.stale_heartbeat_ns, line.gate_wake_ns, line.failed_open_ns = stale, wake, went
        assert r.failed_open(1) is None, "a record is per GPU"
        r._account.proc[2].state = region_mod.SLOT_FREE
        record = r.failed_open(0)
        assert record == region_mod.FailedOpen(heartbeat_ns=40, wake_ns=60, at_ns=62)
        assert record.age_ns == 22


def test_region_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(region_mod.REGION_DIR_ENV, str(tmp_path))
    assert region_mod.region_path("abc") == tmp_path / "abc"
    monkeypatch.delenv(region_mod.REGION_DIR_ENV)
    assert region_mod.region_path("abc") == Path("/run/cgpu_km-regions/abc")


def test_context_charge_defaults_to_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(region_mod.CTX_BYTES_ENV, raising=False)
    assert region_mod.default_ctx_bytes() == region_mod.CTX_MEASURE
    assert region_mod.default_ctx_bytes({region_mod.CTX_BYTES_ENV: "1024"}) == 1024
    with pytest.raises(RegionError, match="not a number of bytes"):
        region_mod.default_ctx_bytes({region_mod.CTX_BYTES_ENV: "1GiB"})


SEEN = st.builds(region_mod.Seen, gpu=st.integers(-2, region_mod.MAX_GPUS + 1),
                 pidns=st.integers(0, 2**64 - 1), pid=st.integers(0, 2**31 - 1),
                 start_time=st.integers(0, 2**64 - 1), bytes=st.integers(0, 2**40))


@settings(max_examples=60, deadline=None)
@given(rounds=st.lists(st.lists(SEEN, max_size=region_mod.MAX_SEEN + 40), min_size=1,
                       max_size=3))
def test_what_the_daemon_saw_reads_back_whatever_it_publishes(
    tmp_path_factory: pytest.TempPathFactory, rounds: list[list[region_mod.Seen]]
) -> None:
    """Each round replaces the last; past MAX_SEEN processes only their bytes are kept (for
    everyone to count), and a GPU the region cannot hold is dropped. A round that
    publishes the same again only dates it anew; nothing after nothing is not
    published at all (an empty view has no age)."""
    with make(tmp_path_factory.mktemp("seen")) as region:
        was_empty = False
        publications = 0
        for published in rounds:
            valid = [s for s in published if 0 <= s.gpu < region_mod.MAX_GPUS]
            for again in (False, True):
                before = region._control.seen_ns
                region.publish_seen(published, now_ns=before + 1)
                quiet = was_empty and not valid
                publications += not quiet
                assert region._control.seen_ns == before + (not quiet), f"dated (again: {again})"
                assert region.seen() == valid[:region_mod.MAX_SEEN]
                for k in range(region_mod.MAX_GPUS):
                    assert region.seen_total(k) == sum(s.bytes for s in valid if s.gpu == k)
                was_empty = not valid
        assert region.seen_rounds == publications
