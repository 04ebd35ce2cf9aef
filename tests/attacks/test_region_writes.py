"""Attacks on what the daemon decides: the control part, the library, the preload file.

Issue 13, attacks 1, 2, 3, 5(c) and 6, each done as it was done against the
old design: inside a real runc container (as uid 65534 and as root without
CAP_SYS_ADMIN, with Docker's default capabilities), and as a host user who
is not root. Each test shows the attack failing and what stays enforced.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
from pathlib import Path

import pytest

from cgpu_km.dataplane import futex
from cgpu_km.dataplane import region as region_mod
from tests.attacks.node import MIB, NOBODY, SETPRIV, Node, fields, missing, wait_for
from tests.libcgpu.sandbox import wait_in_syscall

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing()))]

LIMIT = 256 * MIB
CGPU_256 = {"ALIYUN_COM_GPU_MEM_CONTAINER": "256", "ALIYUN_COM_GPU_MEM_DEV": "15109"}
CONTROL = "/run/cgpu/control"
ACCOUNT = "/run/cgpu/account"
LIBRARY = region_mod.CONTAINER_LIBRARY_PATH
REFUSED = {"EROFS", "EACCES"}
GPU0 = region_mod.ControlLayout.gpu.offset
# Offsets in the control part of what the old attacks rewrote, with the bytes they wrote.
FORGERIES = {
    "limit": (GPU0 + region_mod.GpuEntry.limit.offset, "ffffffffffffff7f"),
    "gate_timeout_ns": (region_mod.ControlLayout.gate_timeout_ns.offset, "0100000000000000"),
    "gate": (GPU0 + region_mod.GpuEntry.gate.offset, "00000000"),
    "heartbeat_ns": (region_mod.ControlLayout.heartbeat_ns.offset, "0000000000000000"),
    "mode": (region_mod.ControlLayout.mode.offset, "01000000"),
    "oom_script": (region_mod.ControlLayout.oom_script.offset, b"/tmp/evil.sh\0".hex()),
}
USERS = pytest.mark.parametrize("user", [NOBODY, 0], ids=["uid65534", "root-inside"])


def octal(data: str) -> str:
    """Hex bytes as a printf(1) format of octal escapes."""
    return "".join(f"\\{int(data[i:i + 2], 16):03o}" for i in range(0, len(data), 2))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class FakeDaemon:
    """The test as the daemon of one region: its gate closed, its heartbeat fresh."""

    def __init__(self, region: region_mod.Region) -> None:
        self.region = region
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self._stop.is_set():
            self.region.heartbeat()
            self._stop.wait(0.05)

    def __enter__(self) -> FakeDaemon:
        self.region.set_gate(0, False)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def control_decisions(region: region_mod.Region) -> tuple[object, ...]:
    """Everything the daemon decides that the attacks tried to change."""
    return (region.limit(0), region.gate_timeout_ns, region.mode, region.oom_script,
            region.gpu_spec(0))


@USERS
def test_a_container_cannot_raise_its_limit_or_open_its_gate(
    node: Node, user: int
) -> None:
    """Attack 1: `dd` into the control part's limit, gate_timeout_ns=1, mmap for writing."""
    container = node.container(CGPU_256, user=user)
    region = container.region()
    with FakeDaemon(region):
        before = control_decisions(region)
        attacker = container.proc()
        limit_at, limit_bytes = FORGERIES["limit"]
        dd = container.sh(f"printf '{octal(limit_bytes)}' | "
                          f"dd of={CONTROL} bs=1 seek={limit_at} conv=notrunc; echo status=$?")
        assert "status=1" in dd, dd
        assert "Read-only file system" in dd or "Permission denied" in dd, dd
        for name, (offset, data) in FORGERIES.items():
            answer = attacker.ask(f"write {CONTROL} {offset} {data}").split()[1]
            assert answer in REFUSED, name
        mapped = fields(attacker.ask(f"mapwrite {CONTROL}"))
        assert mapped["open_rdwr"] in REFUSED
        assert mapped["map_rw"] == "EACCES"
        assert mapped["mprotect"] == "EACCES"
        tried = container.sh(f"chmod 666 {CONTROL}; rm -f {CONTROL}; mv {CONTROL} /tmp/c; "
                             f"umount {CONTROL}; echo owner=$(stat -c %u:%a {CONTROL})")
        # runc relays stdout and stderr on two pipes: their lines come in any order
        assert "owner=0:644" in tried.split(), tried  # still there, root's, 0644
        assert control_decisions(region) == before

        # The limit holds: libcgpu refuses past 256 MiB, and simgpu's own accounting agrees.
        assert attacker.ask(f"alloc {200 * MIB}") == "alloc rc=0"
        assert attacker.ask(f"alloc {LIMIT - 200 * MIB + 1}") == "alloc rc=2"  # out of memory
        assert fields(attacker.ask("info"))["total"] == str(LIMIT)
        assert node.nvml_processes()[attacker.host_pid] == 200 * MIB
        # The gate holds: launches wait while the (fake) daemon keeps it closed.
        attacker.send("launch 3 1000")
        wait_for(lambda: region.activity(0).pending == 1, 10, "the launch waiting at the gate")
        wait_in_syscall(attacker.host_pid, attacker.host_pid, futex._SYS_FUTEX,
                        "the launch at a closed gate", running=attacker.alive)
        assert region.activity(0).launches == 0
        region.set_gate(0, True)
        assert attacker.read_line(5) == "launch n=3 rc=0"
    region.close()


PROBE = """
import errno, json, os, sys
script, oom_at, folders, files = sys.argv[1], int(sys.argv[2]), *map(json.loads, sys.argv[3:])
found = {}
def attempt(what, action):
    try:
        action()
        found[what] = "done"
    except OSError as error:
        found[what] = errno.errorcode[error.errno]
def write(path):
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, script.encode() + b"\\0", oom_at)
    finally:
        os.close(fd)
for folder in folders:
    attempt(folder + " list", lambda: os.listdir(folder))
    attempt(folder + " create", lambda: os.close(os.open(folder + "/x", os.O_CREAT | os.O_RDWR)))
for path in files:
    attempt(path + " read", lambda: os.close(os.open(path, os.O_RDONLY)))
    attempt(path + " write", lambda: write(path))
print(json.dumps(found))
"""


def probe_as_nobody(folders: list[Path], files: list[Path], script: str) -> dict[str, str]:
    """As uid/gid 65534 on the host: list and create in `folders`, open `files` for
    reading, and for writing (then write `script` over the control part's OOM script).
    What each attempt got: "done" or the errno's name."""
    assert SETPRIV is not None
    result = subprocess.run(
        [SETPRIV, "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
         PROBE, script, str(region_mod.ControlLayout.oom_script.offset),
         json.dumps([str(f) for f in folders]), json.dumps([str(f) for f in files])],
        capture_output=True, text=True, timeout=30, cwd="/")
    assert result.returncode == 0, result.stderr
    found: dict[str, str] = json.loads(result.stdout)
    return found


def test_a_host_user_cannot_open_a_jobs_or_a_containers_region(node: Node) -> None:
    """Attacks 2 and 5(c): `nobody` on the host against a running `cgpu-run` job's region
    and a runc container's region: read, write, or name an OOM script of its own."""
    job = node.cgpu_run("rootjob", ["sleep", "120"], "--memsize", str(LIMIT))
    node.sim.wait_registered("rootjob")
    container = node.container(CGPU_256, user=0)
    job_region = region_mod.region_path("rootjob", node.region_dir)
    wait_for(lambda: (job_region / region_mod.CONTROL_NAME).exists(), 10, "the job's region")
    regions = [job_region, container.region_path]
    hashes = {path: sha256(path) for r in regions for path in r.iterdir()}

    folder = node.region_dir.stat()
    assert (folder.st_uid, folder.st_mode & 0o7777) == (0, 0o700)
    assert node.base.stat().st_mode & 0o005 == 0o005  # the folder above lets nobody through
    script = node.base / "evil.sh"
    script.write_text("#!/bin/sh\ntouch /tmp/cgpu-attack-evil-ran\n")
    script.chmod(0o755)
    folders = [node.region_dir, *regions]
    files = [region / name for region in regions
             for name in (region_mod.CONTROL_NAME, region_mod.ACCOUNT_NAME, "owner.json")]
    init = container.init_pid()
    files += [Path(f"/proc/{init}/root{CONTROL}"), Path(f"/proc/{init}/root{ACCOUNT}")]
    found = probe_as_nobody(folders, files, str(script))
    assert len(found) == 2 * (len(folders) + len(files))
    assert {what: why for what, why in found.items() if why != "EACCES"} == {}
    assert {path: sha256(path) for path in hashes} == hashes
    assert job.poll() is None


def test_root_inside_cannot_replace_the_library_or_the_preload(node: Node) -> None:
    """Attack 3: root in the container writes the mounted libcgpu.so and /etc/ld.so.preload."""
    container = node.container(CGPU_256, user=0)
    preload_on_host = container.region_path / "ld.so.preload"
    before = {path: sha256(path) for path in (node.library, preload_on_host)}
    attacker = container.proc()
    for path in (LIBRARY, "/etc/ld.so.preload"):
        assert attacker.ask(f"write {path} 0 7f454c46").split()[1] == "EROFS", path
        assert fields(attacker.ask(f"mapwrite {path}"))["open_rdwr"] == "EROFS"
    tried = container.sh(
        f"echo /tmp/evil.so > /etc/ld.so.preload; echo x >> {LIBRARY}; "
        f"truncate -s 0 {LIBRARY}; dd if=/dev/zero of={LIBRARY} bs=1 count=1 conv=notrunc; "
        f"chmod 777 {LIBRARY} /etc/ld.so.preload; rm -f /etc/ld.so.preload {LIBRARY}; "
        f"umount /etc/ld.so.preload {LIBRARY}; echo preload=$(cat /etc/ld.so.preload)")
    assert f"preload={LIBRARY}" in tried.split(), tried
    assert {path: sha256(path) for path in before} == before
    # and a new process still loads the library: it sees the limit
    assert fields(container.run("info")[0])["total"] == str(LIMIT)


@USERS
def test_an_empty_or_forged_cgpu_region_does_not_switch_libcgpu_off(
    node: Node, user: int
) -> None:
    """Attack 6: `CGPU_REGION= ./prog` (and a region of the container's own making, and an
    empty LD_PRELOAD) in a container whose ld.so.preload loads libcgpu."""
    container = node.container(CGPU_256, user=user)
    limit_at, limit_bytes = FORGERIES["limit"]
    made = container.sh(
        f"mkdir -p /tmp/fake && cp {CONTROL} {ACCOUNT} /tmp/fake/ && "
        f"printf '{octal(limit_bytes)}' | "
        f"dd of=/tmp/fake/control bs=1 seek={limit_at} conv=notrunc 2>&1 && echo made")
    assert made.strip().endswith("made"), made
    for env in ({"CGPU_REGION": ""}, {"CGPU_REGION": "/tmp/fake"},
                {"CGPU_REGION": "", "LD_PRELOAD": ""}):
        info, nvml, alloc = container.run("info", "nvml", f"alloc {LIMIT + 1}", env=env)
        assert fields(info)["total"] == str(LIMIT), env
        assert fields(nvml)["total"] == str(LIMIT), env
        assert alloc == "alloc rc=2", env
    first, second = container.run(f"alloc {LIMIT}", "alloc 1", env={"CGPU_REGION": ""})
    assert (first, second) == ("alloc rc=0", "alloc rc=2")
