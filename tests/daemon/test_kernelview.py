"""Which container a process belongs to, as the kernel says; the backstop's decisions."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cgpu_km.daemon.backstop import Grandfather, over_limit
from cgpu_km.dataplane import kernelview
from cgpu_km.dataplane import region as region_mod
from cgpu_km.dataplane.attribution import Attribution, Nvml, measure
from cgpu_km.dataplane.kernelview import Host, Owner, ProcessInfo
from cgpu_km.dataplane.registry import Registry

HOST = Host(pidns=100, cgroups={"0::": {"/"}, "4:memory": {"/", "/daemon"}})


def info(pidns: int = 100, cgroups: dict[str, str] | None = None) -> ProcessInfo:
    return ProcessInfo(pid=42, pidns=pidns, inner_pid=7, start_time=1, uid=0, gid=0,
                       cgroups=cgroups if cgroups is not None else {"0::": "/"})


def test_a_container_is_its_pid_namespace_and_its_cgroup() -> None:
    """Where the owner has both, both must agree: a host process moved into the
    container's cgroup is not the container's, nor is a process of its pid
    namespace in another container's cgroup (a shared pid namespace)."""
    owner = Owner(pidns=200, cgroups={"0::": "/docker/abc", "4:memory": "/docker/abc"})
    assert kernelview.belongs(info(pidns=200, cgroups={"0::": "/docker/abc"}), owner, HOST)
    assert kernelview.belongs(info(pidns=200, cgroups={"0::": "/docker/abc/sub"}), owner, HOST)
    assert kernelview.belongs(info(pidns=200, cgroups={"4:memory": "/docker/abc"}), owner, HOST)
    assert not kernelview.belongs(info(pidns=200), owner, HOST), "another cgroup"
    assert not kernelview.belongs(info(pidns=200, cgroups={"0::": "/docker/abcd"}), owner, HOST)
    assert not kernelview.belongs(info(cgroups={"0::": "/docker/abc"}), owner, HOST), \
        "a host process in the container's cgroup"
    assert not kernelview.belongs(info(pidns=300, cgroups={"0::": "/docker/abc"}), owner, HOST)
    assert not kernelview.belongs(info(), owner, HOST)


def test_what_the_owner_does_not_know_does_not_decide() -> None:
    """`cgpu-run` records a pid namespace alone; a container in the host's pid
    namespace (or one whose cgroups are the host's) has only the other."""
    job = Owner(pidns=200, cgroups={})
    assert kernelview.belongs(info(pidns=200, cgroups={"0::": "/anywhere"}), job, HOST)
    assert not kernelview.belongs(info(cgroups={"0::": "/anywhere"}), job, HOST)
    host_pid = Owner(pidns=100, cgroups={"0::": "/docker/abc"})
    assert kernelview.belongs(info(cgroups={"0::": "/docker/abc/x"}), host_pid, HOST)
    assert not kernelview.belongs(info(cgroups={"0::": "/docker/other"}), host_pid, HOST)
    host_cgroups = Owner(pidns=200, cgroups={"0::": "/", "4:memory": "/daemon"})
    assert kernelview.belongs(info(pidns=200, cgroups={"0::": "/elsewhere"}), host_cgroups, HOST)
    assert not kernelview.belongs(info(cgroups={"4:memory": "/daemon"}), host_cgroups, HOST)


SHARED = {"a": Owner(pidns=200, cgroups={"0::": "/pod/a"}),
          "b": Owner(pidns=200, cgroups={"0::": "/pod/b"})}


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_containers_that_share_a_pid_namespace_each_have_their_own(
        order: tuple[str, str]) -> None:
    """Kubernetes' shareProcessNamespace, Docker's --pid=container: the cgroup decides,
    whatever order the containers come in; a process in neither cgroup is nobody's."""
    index = kernelview.OwnerIndex({name: SHARED[name] for name in order}, HOST)
    assert index.find(info(pidns=200, cgroups={"0::": "/pod/a"})) == "a"
    assert index.find(info(pidns=200, cgroups={"0::": "/pod/b/sub"})) == "b"
    assert index.find(info(pidns=200, cgroups={"0::": "/pod/c"})) is None
    assert index.find(info(pidns=200, cgroups={"0::": "/pod"})) is None
    assert index.find(info(pidns=100, cgroups={"0::": "/pod/a"})) is None, "a host process"


def test_a_process_two_containers_hold_alike_is_nobodys() -> None:
    """Two containers of one pid namespace and one cgroup cannot be told apart: neither
    is guessed. A cgroup below the other's holds its processes more closely."""
    same = {"a": SHARED["a"], "b": Owner(pidns=200, cgroups={"0::": "/pod/a"})}
    assert kernelview.OwnerIndex(same, HOST).find(
        info(pidns=200, cgroups={"0::": "/pod/a"})) is None
    nested = {"a": SHARED["a"], "b": Owner(pidns=200, cgroups={"0::": "/pod/a/b"})}
    index = kernelview.OwnerIndex(nested, HOST)
    assert index.find(info(pidns=200, cgroups={"0::": "/pod/a/b/x"})) == "b"
    assert index.find(info(pidns=200, cgroups={"0::": "/pod/a/x"})) == "a"


OWNERS = st.builds(
    Owner, pidns=st.sampled_from([0, 100, 200, 300]),
    cgroups=st.dictionaries(st.sampled_from(["0::", "4:memory"]),
                            st.sampled_from(["/", "/daemon", "/p", "/p/a", "/p/b", "/q"]),
                            max_size=2))
PROCESSES = st.builds(
    lambda pidns, cgroups: info(pidns=pidns, cgroups=cgroups),
    st.sampled_from([100, 200, 300, 400]),
    st.dictionaries(st.sampled_from(["0::", "4:memory"]),
                    st.sampled_from(["/", "/daemon", "/p", "/p/a", "/p/a/x", "/p/b", "/q"]),
                    max_size=2))


@given(st.dictionaries(st.sampled_from("abcd"), OWNERS, max_size=4), PROCESSES)
def test_the_index_answers_as_belongs(owners: dict[str, Owner], process: ProcessInfo) -> None:
    """The index names only a container `belongs` puts the process in, and names the
    one when there is one."""
    found = kernelview.OwnerIndex(owners, HOST, "/nonexistent").find(process)
    holders = {name for name, owner in owners.items()
               if kernelview.belongs(process, owner, HOST, "/nonexistent")}
    if found is not None:
        assert found in holders
    if len(holders) == 1:
        assert found in holders
    if not holders:
        assert found is None


def test_the_hosts_namespace_and_cgroups_identify_nothing() -> None:
    like_host = Owner(pidns=100, cgroups={"0::": "/", "4:memory": "/daemon"})
    assert not kernelview.belongs(info(), like_host, HOST)
    assert not kernelview.belongs(info(pidns=300), like_host, HOST)
    assert not kernelview.belongs(info(cgroups={"4:memory": "/daemon"}), like_host, HOST)


def test_owner_round_trips_and_bad_files_are_none(tmp_path: Path) -> None:
    owner = Owner(pidns=5, cgroups={"0::": "/a"}, pid=9, start_time=11)
    kernelview.write_owner(tmp_path, owner)
    assert kernelview.read_owner(tmp_path) == owner
    assert (tmp_path / kernelview.OWNER_NAME).stat().st_mode & 0o777 == 0o600
    for text in ("", "[]", '{"pidns": "x"}', '{"pidns": 1, "cgroups": {"a": 1}}'):
        (tmp_path / kernelview.OWNER_NAME).write_text(text)
        assert kernelview.read_owner(tmp_path) is None, text


@given(st.text(max_size=200))
def test_parsers_never_raise_on_odd_cgroup_files(text: str) -> None:
    for key, path in kernelview.parse_cgroups(text).items():
        assert ":" in key
        assert isinstance(path, str)


@given(st.binary(min_size=0, max_size=15).filter(lambda name: b"\0" not in name),
       st.sampled_from("RSDZT"), st.integers(0, 2**63))
def test_stat_is_parsed_whatever_the_process_is_named(name: bytes, state: str,
                                                      start: int) -> None:
    """The name in stat is raw: any bytes but NUL, parentheses and newlines too."""
    tail = " ".join(["1"] * 18 + [str(start), "0"])
    text = (b"42 (" + name + f") {state} {tail}\n".encode()).decode(errors="surrogateescape")
    assert kernelview.parse_stat(text) == (state, start)


def test_process_info_of_this_process() -> None:
    me = kernelview.process_info(os.getpid())
    assert me is not None
    assert me.pidns == os.stat("/proc/self/ns/pid").st_ino
    assert me.inner_pid == os.getpid()
    assert me.uid == os.getuid()
    assert kernelview.process_info(2**22 + 12345) is None


@pytest.mark.parametrize("name", [b"\xff)\xfe(", b") R 1 2 3 (", b"\xc3"])
def test_a_process_that_names_itself_in_any_bytes_is_still_seen(name: bytes) -> None:
    """A process's name is its own choice of bytes (UTF-8 or not, parentheses and
    all), and /proc shows it in stat and status."""
    rename = (f"import ctypes, sys; ctypes.CDLL(None).prctl(15, {name!r}, 0, 0, 0); "
              "print(flush=True); sys.stdin.read()")
    with subprocess.Popen([sys.executable, "-c", rename], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None
            child.stdout.readline()  # renamed
            with open(f"/proc/{child.pid}/comm", "rb") as comm:
                assert comm.read().rstrip(b"\n") == name
            # Stopped and reaped as stopped, its state can only be T: a state
            # read while it runs on to its read() would be R or S by chance.
            os.kill(child.pid, signal.SIGSTOP)
            os.waitpid(child.pid, os.WUNTRACED)
            info = kernelview.process_info(child.pid)
            assert info is not None
            assert (info.inner_pid, info.state) == (child.pid, "T")
            assert kernelview.process_state(child.pid) == ("T", info.start_time)
        finally:
            child.kill()


def test_running_knows_a_process_until_it_exits_and_never_its_pid_reused() -> None:
    """Found once by a scan of /proc, then followed by its stat alone: running
    while it runs, gone once it exited, and a slot naming the same process with
    another start time (a pid reused) is not running."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = kernelview.process_info(sleeper.pid)
        assert me is not None
        key = (me.pidns, me.inner_pid, me.start_time)
        reused = (me.pidns, me.inner_pid, me.start_time + 1)
        attribution = Attribution()
        for _ in range(3):  # the scan, the full read, then the stat alone
            assert attribution.running({key, reused}) == {key}
            assert attribution.host_pid(key) == sleeper.pid
        seen = attribution.running_info(sleeper.pid)
        assert seen is not None
        assert (seen.pidns, seen.inner_pid, seen.start_time) == key
        sleeper.kill()
        sleeper.wait()
        assert attribution.running({key, reused}) == set()
        assert attribution.host_pid(key) == 0
    finally:
        sleeper.kill()
        sleeper.wait()


def fake_process(proc: Path, pid: int, start: int, uid: int, state: str = "S") -> None:
    """A /proc/<pid> with the files `process_info` reads."""
    base = proc / str(pid)
    (base / "ns").mkdir(parents=True, exist_ok=True)
    (base / "ns" / "pid").touch()
    fields = [state, *["0"] * 18, str(start)]
    (base / "stat").write_text(f"{pid} (worker) {' '.join(fields)}\n")
    (base / "status").write_text(f"Name:\tworker\nNSpid:\t{pid}\nUid:\t{uid}\t{uid}\n"
                                 f"Gid:\t0\t0\nCapBnd:\t0\n")
    (base / "cgroup").write_text("0::/ctr\n")


def test_known_info_reads_a_process_once_until_its_pid_names_another(tmp_path: Path) -> None:
    """The memory round's look: the first read of a process is kept while its
    stat shows the same start time (its status is not read again), read afresh
    for a pid reused by a new process, and None once it is gone."""
    fake_process(tmp_path, 1, start=1, uid=0)
    (tmp_path / "self").symlink_to(tmp_path / "1")
    fake_process(tmp_path, 4242, start=500, uid=1000)
    attribution = Attribution(str(tmp_path))
    first = attribution.known_info(4242)
    assert first is not None
    assert first.uid == 1000
    fake_process(tmp_path, 4242, start=500, uid=2000)  # the status alone changed
    assert attribution.known_info(4242) is first
    fresh = attribution.info(4242)
    assert fresh is not None
    assert fresh.uid == 2000
    fake_process(tmp_path, 4242, start=900, uid=3000)  # the pid names a new process
    again = attribution.known_info(4242)
    assert again is not None
    assert (again.start_time, again.uid) == (900, 3000)
    shutil.rmtree(tmp_path / "4242")
    assert attribution.known_info(4242) is None


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
def test_a_process_in_a_pid_namespace_and_its_children_belong_to_it() -> None:
    job = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--",
                            "sh", "-c", "sleep 30 & sleep 30"])
    try:
        deadline = time.monotonic() + 5
        children: list[int] = []
        while len(children) < 1 and time.monotonic() < deadline:
            text = Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text()
            children = [int(p) for p in text.split()]
            time.sleep(0.01)
        init = children[0]
        owner = kernelview.owner_of(init)
        assert owner is not None
        host = Host.read()
        assert owner.pidns != host.pidns
        grandchildren: list[int] = []
        while not grandchildren and time.monotonic() < deadline:
            grandchildren = [int(p) for p in
                             Path(f"/proc/{init}/task/{init}/children").read_text().split()]
            time.sleep(0.01)
        inside = kernelview.process_info(grandchildren[0])
        assert inside is not None
        assert kernelview.belongs(inside, owner, host)
        outside = kernelview.process_info(os.getpid())
        assert outside is not None
        assert not kernelview.belongs(outside, owner, host)
    finally:
        job.kill()
        job.wait()


def test_over_limit_picks_largest_first_and_ignores_unlimited() -> None:
    assert over_limit({1: 5, 2: 7, 3: 1}, 6) == [2]
    assert over_limit({1: 5, 2: 7, 3: 1}, 2) == [2, 1]
    assert over_limit({1: 5}, 5) == []
    assert over_limit({1: 5}, 0) == []


def test_a_lowered_limit_grandfathers_what_was_held_until_it_fits() -> None:
    gf = Grandfather()
    key = (0, "a")
    assert gf.limit(key, 1000, 900, lowered=False) == 1000
    assert gf.limit(key, 500, 900, lowered=True) == 900, "what it held stays"
    assert gf.limit(key, 500, 950, lowered=False) == 900, "but it may not grow"
    assert gf.limit(key, 500, 400, lowered=False) == 500, "under the new limit: it holds"
    assert gf.limit(key, 500, 900, lowered=False) == 500
    gf.forget(set())


@given(limit=st.integers(1, 10**6), usage=st.integers(0, 10**6))
def test_grandfathered_limit_is_never_below_the_limit(limit: int, usage: int) -> None:
    got = Grandfather().limit((0, "a"), limit, usage, lowered=True)
    assert got >= limit
    assert got == max(limit, usage)


def test_nsexec_refuses_a_process_that_is_gone() -> None:
    owner = kernelview.Owner(pidns=1, cgroups={}).to_json()
    result = subprocess.run([sys.executable, "-m", "cgpu_km.container.nsexec", "--pid", "999999999",
                             "--owner", owner, "--", "true"], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 125
    assert "cannot enter the container of pid 999999999" in result.stderr


@pytest.mark.parametrize("owner", ["", "[]", '{"cgroups": {}}', '{"pidns": "x", "cgroups": {}}',
                                   '{"pidns": 1, "cgroups": {"0::": 5}}'])
def test_nsexec_refuses_an_owner_that_is_no_identity(owner: str, tmp_path: Path) -> None:
    """Without the container's identity nothing runs: one line names --owner."""
    marker = tmp_path / "ran"
    result = subprocess.run([sys.executable, "-m", "cgpu_km.container.nsexec",
                             f"--pid={os.getpid()}", f"--owner={owner}", "--", "touch",
                             str(marker)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "--owner is not a container identity" in result.stderr.splitlines()[-1]
    assert not marker.exists()


class RowsNvml:
    """NVML's rows as `Nvml.memory_by_pid` returns them, for `measure`."""

    def __init__(self, rows: dict[tuple[int, int], int]) -> None:
        self.rows = rows

    def memory_by_pid(self) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
        return dict(self.rows), {0: sum(self.rows.values())}


def test_containers_sharing_a_pid_namespace_are_measured_apart(tmp_path: Path) -> None:
    """A fake /proc: containers a and b share one pid namespace (one ns/pid inode), each in
    a cgroup of its own. NVML's processes are each counted in their own container's; one of
    that namespace in neither cgroup, and a host process moved into a's cgroup, are
    nobody's."""
    proc = tmp_path / "proc"
    fake_process(proc, 1, start=1, uid=0)
    (proc / "1" / "cgroup").write_text("0::/\n")
    (proc / "self").symlink_to(proc / "1")
    shared = tmp_path / "shared-pidns"  # the inode of the one pid namespace
    shared.touch()
    for pid, cgroup in ((501, "/pod/a"), (502, "/pod/b"), (601, "/pod/a"), (602, "/pod/b/x"),
                        (603, "/pod/c"), (700, "/pod/a")):
        fake_process(proc, pid, start=pid, uid=0)
        (proc / str(pid) / "cgroup").write_text(f"0::{cgroup}\n")
        (proc / str(pid) / "ns" / "pid").unlink()
        # 700 is in the host's namespace: the host's process, moved into a's cgroup
        os.link(proc / "1" / "ns" / "pid" if pid == 700 else shared,
                proc / str(pid) / "ns" / "pid")
    regions = tmp_path / "regions"
    owners = {}
    for name, init in (("a", 501), ("b", 502)):
        region_mod.Region.create(regions / name, name, [region_mod.GpuSpec(512 << 20)]).close()
        owner = kernelview.owner_of(init, str(proc))
        assert owner is not None
        kernelview.write_owner(regions / name, owner)
        owners[name] = owner
    assert owners["a"].pidns == owners["b"].pidns == shared.stat().st_ino
    registry = Registry(regions)
    registry.attach({0: {"a", "b"}})
    rows = {(0, 601): 10, (0, 602): 20, (0, 603): 30, (0, 700): 40}
    for _ in range(2):  # the second round from what the first one read
        view = measure(registry, RowsNvml(rows), Attribution(str(proc)))  # type: ignore[arg-type]
        assert {key: dict(found.procs) for key, found in view.by_container.items()} == {
            (0, "a"): {601: 10}, (0, "b"): {602: 20}}
        assert view.stray == {0: {603: 30, 700: 40}}
    for entry in registry.all():
        entry.region.close()


class RepeatingNvml:
    """Just enough of pynvml: one process listed once per context, as NVIDIA's driver
    does in some versions (and simgpu for a process with two copies of libcuda)."""

    class NVMLError(Exception):
        pass

    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list[object]:
        if handle == 1:
            raise self.NVMLError("gone")
        return [SimpleNamespace(pid=7, usedGpuMemory=3 << 30),
                SimpleNamespace(pid=8, usedGpuMemory=None),
                SimpleNamespace(pid=7, usedGpuMemory=64 << 20)]

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> object:
        return SimpleNamespace(used=5 << 30)


def test_every_nvml_row_of_a_process_counts() -> None:
    """Issue 36, item 2: 3 GiB through a copy of libcuda and 64 MiB through libcgpu are
    3136 MiB, not the last row's 64."""
    nvml = Nvml.__new__(Nvml)
    nvml.nvml, nvml.handles = RepeatingNvml(), {0: 0, 1: 1}
    procs, used = nvml.memory_by_pid()
    assert procs == {(0, 7): (3 << 30) + (64 << 20), (0, 8): 0}
    assert used == {0: 5 << 30, 1: 5 << 30}
