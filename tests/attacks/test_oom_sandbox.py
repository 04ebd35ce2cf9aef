"""Issue 19, item 5: the eGPU OOM script runs as sandboxed as the container's own
processes, and never on the host.

The script is the container's choice. `cgpu_km.container.nsexec` pins the process
with a pidfd, checks that it is still the container's (pid namespace or cgroup of the
recorded owner) and not in the host's mount or pid namespace, and gives the script the
container's seccomp filter (copied from the process) and LSM label.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpu_km.dataplane import kernelview
from tests.attacks.node import MIB, Node, missing
from tests.attacks.test_backstop import STOPPED
from tests.attacks.test_oom_and_memsize import egpu_env, lower_memsize

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing()))]

# Docker's default profile refuses both; this one refuses only them (errno 1: EPERM).
REFUSE_UNSHARE_AND_KEYCTL = {
    "defaultAction": "SCMP_ACT_ALLOW",
    "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_AARCH64"],
    "syscalls": [{"names": ["unshare", "keyctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}],
}
SCRIPT = "/oom.sh"
RECORDER = ("#!/bin/sh\n/attacker syscalls > /out/syscalls\n"
            "unshare -U /bin/true 2> /out/unshare; echo status=$? >> /out/unshare\n")


def nsexec(pid: int, owner: kernelview.Owner, *program: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cgpu_km.container.nsexec", f"--pid={pid}",
                           f"--owner={owner.to_json()}", "--", *program],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("seccomp", [True, False], ids=["filtered", "unfiltered"])
def test_the_oom_script_gets_the_containers_seccomp_filter(node: Node, seccomp: bool) -> None:
    """A container whose filter refuses unshare and keyctl: its processes get EPERM, and so
    does its OOM script, run by the daemon when the operator lowers the limit below what a
    process holds. Without a filter the same script's unshare goes through (the control)."""
    node.start_daemon()
    container = node.container(egpu_env(512, SCRIPT), user=0, files={SCRIPT: RECORDER},
                               seccomp=REFUSE_UNSHARE_AND_KEYCTL if seccomp else None)
    refused = "syscalls unshare=EPERM keyctl=EPERM"
    own = container.run("syscalls")[0]
    assert (own == refused) is seccomp, own
    holder = container.proc()
    assert holder.ask(f"alloc {400 * MIB}") == "alloc rc=0"
    lower_memsize(node, container, 256 * MIB)
    assert holder.wait(30) == STOPPED
    assert ((container.out / "syscalls").read_text().strip() == refused) is seccomp
    unshared = (container.out / "unshare").read_text()
    assert unshared.endswith("status=0\n") is not seccomp, unshared
    if seccomp:
        assert "Operation not permitted" in unshared, unshared


@contextlib.contextmanager
def host_process(cgroup: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A host `sleep` (in `cgroup`, a cgroup folder, when given)."""
    process = subprocess.Popen(["sleep", "600"])
    try:
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(f"{process.pid}\n")
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_pid_reused_by_a_host_process_runs_no_script(node: Node, tmp_path: Path) -> None:
    """The container's process exited and its pid now names a host process: nsexec, given
    that pid and the container's recorded owner, runs nothing, on the host least of all."""
    container = node.container(egpu_env(512, SCRIPT))
    owner = kernelview.read_owner(container.region_path)
    assert owner is not None
    marker = tmp_path / "ran-on-the-host"
    with host_process() as reused:
        result = nsexec(reused.pid, owner, "/bin/sh", "-c", f"touch {marker}")
    assert result.returncode == 125, result.stderr
    assert f"pid {reused.pid} is not a process of the container" in result.stderr
    assert not marker.exists()
    # the same call with a process that is the container's runs (inside: no marker here)
    inside = nsexec(container.init_pid(), owner, "/bin/sh", "-c", "echo inside > /out/ran")
    assert inside.returncode == 0, inside.stderr
    assert (container.out / "ran").read_text() == "inside\n"


def test_a_host_process_in_the_containers_cgroup_runs_no_script(tmp_path: Path) -> None:
    """A host process put in the cgroup a container's owner names is not the container's
    when the owner has a pid namespace of its own (both must agree). For a container in
    the host's pid namespace, whose cgroup alone identifies it, the process belongs to it
    by the cgroup, but its mount and pid namespaces are the host's: nsexec refuses."""
    hierarchy = Path("/sys/fs/cgroup/pids")
    if not (hierarchy / "cgroup.procs").exists():
        hierarchy = Path("/sys/fs/cgroup")  # cgroup v2
    key = "0:" if hierarchy.name == "cgroup" else next(
        key for key in kernelview.parse_cgroups(Path("/proc/self/cgroup").read_text())
        if key.endswith(":pids"))
    cgroup = hierarchy / f"cgpu-test-{uuid.uuid4().hex[:12]}"
    cgroup.mkdir()
    marker = tmp_path / "ran-on-the-host"
    try:
        owner = kernelview.Owner(pidns=0, cgroups={key: f"/{cgroup.name}"})
        with host_process(cgroup) as process:
            info = kernelview.process_info(process.pid)
            assert info is not None
            host = kernelview.Host.read()
            assert not kernelview.belongs(info, dataclasses.replace(owner, pidns=1), host)
            assert kernelview.belongs(info, owner, host)
            result = nsexec(process.pid, owner, "/bin/sh", "-c", f"touch {marker}")
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(cgroup)
    assert result.returncode == 125, result.stderr
    assert f"pid {process.pid} is in the host's mnt namespace" in result.stderr
    assert not marker.exists()
