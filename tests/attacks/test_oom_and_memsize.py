"""Attacks through the OOM script, and the operator's live memsize.

Issue 13, attacks 5(a), 5(b) and 7, with the real daemon, which carries a
memsize written in the tree into the region within a period and stops eGPU
processes over their limit (the OOM script first, run inside the container
by `cgpu_km.container.nsexec`).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpu_km.dataplane import region as region_mod
from tests.attacks.node import MIB, NOBODY, Container, Node, fields, missing, wait_for
from tests.attacks.test_backstop import STOPPED, cgpu_mem, over_limit_logged, stopped_or_refused

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing()))]

CONTROL = "/run/cgpu/control"
# What a script inside the container records: its uid, a file only the container has,
# its mount and pid namespaces, and the pid it was told about.
RECORDER = ("#!/bin/sh\n{ id -u; cat /container-only; readlink /proc/self/ns/mnt; "
            "readlink /proc/self/ns/pid; echo \"$CGPU_OOM_PID\"; } > /out/record\n")


def egpu_env(mib: int, script: str) -> dict[str, str]:
    """An eGPU container with a limit of `mib` MiB (after the 10 MiB reserve) and a script."""
    return {"AMP_VGPU_ENABLE": "1", "GPU_MEM_PER_DEVICE": str((mib + 10) * MIB),
            "ALIYUN_COM_GPU_OOM_SCRIPT": script}


@pytest.fixture
def host_script() -> Iterator[tuple[str, Path]]:
    """A script at a path that exists on the host only; it leaves a marker when it runs."""
    folder = Path(f"/tmp/cgpu-attack-oom-{uuid.uuid4().hex[:12]}")
    folder.mkdir(mode=0o755)
    marker = folder / "ran-on-the-host"
    script = folder / "oom.sh"
    script.write_text(f"#!/bin/sh\nid -u > {marker}\n")
    script.chmod(0o755)
    try:
        yield str(script), marker
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def namespace(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def lower_memsize(node: Node, container: Container, limit: int) -> None:
    """`echo LIMIT > tree/0/<ctr>/memsize`, then wait for the daemon to put it in the region."""
    node.echo(f"0/{container.id12}/memsize", limit)
    with container.region() as region:
        wait_for(lambda: region.limit(0) == limit, 2, "the daemon carrying memsize to the region")


@pytest.mark.parametrize("inside", [False, True], ids=["host-only", "also-in-container"])
def test_the_egpu_oom_script_runs_inside_the_container_never_on_the_host(
    node: Node, host_script: tuple[str, Path], inside: bool
) -> None:
    """Attacks 5(a) and 7 (eGPU): a container as uid 65534 names a host-only script as its
    OOM script; the operator lowers its memsize below what it holds."""
    path, marker = host_script
    files = {"/container-only": "inside\n", **({path: RECORDER} if inside else {})}
    node.start_daemon()
    container = node.container(egpu_env(512, path), user=NOBODY, files=files)
    holder = container.proc()
    assert holder.ask(f"alloc {400 * MIB}") == "alloc rc=0"
    wait_for(lambda: node.meminfo(container)[1] == {holder.host_pid: 400 * MIB}, 3,
             "the daemon measuring the container")
    init = container.init_pid()
    lower_memsize(node, container, 256 * MIB)
    assert holder.wait(8) == STOPPED
    assert not marker.exists(), "the container's OOM script ran on the host"
    record = container.out / "record"
    if not inside:
        assert not record.exists()
        return
    assert record.read_text().split() == [
        str(NOBODY), "inside", namespace(init, "mnt"), namespace(init, "pid"), str(holder.pid)]


def test_a_container_cannot_name_a_script_of_its_rootfs_in_its_region(node: Node) -> None:
    """Attack 5(b): root in a cGPU container writes a script into its rootfs, finds the
    rootfs's host path in /proc/self/mountinfo, and sets eGPU mode and that script in its
    region; then one of its processes goes over its limit."""
    node.start_daemon()
    marker = node.base / "ran-on-the-host"
    container = node.container(cgpu_mem(256), user=0)
    found = container.sh(
        f"printf '#!/bin/sh\\ntouch {marker}\\n' > /evil.sh && chmod 755 /evil.sh && "
        "grep -E '^[0-9]+ [0-9]+ [^ ]+ [^ ]+ / ' /proc/self/mountinfo")
    assert str(container.rootfs) in found  # where the rootfs is on the host
    script = f"{container.rootfs}/evil.sh\0".encode().hex()
    attacker = container.proc()
    mode_at = region_mod.ControlLayout.mode.offset
    oom_at = region_mod.ControlLayout.oom_script.offset
    assert attacker.ask(f"write {CONTROL} {mode_at} 01000000") == "write EROFS"
    assert attacker.ask(f"write {CONTROL} {oom_at} {script}") == "write EROFS"
    with container.region() as region:
        assert (region.mode, region.oom_script) == ("cgpu", "")
    assert attacker.ask(f"alloc {200 * MIB}") == "alloc rc=0"
    assert attacker.ask("forge-own 1 4026539999 0") == "forge-own ok"
    stopped_or_refused(attacker, attacker.ask(f"alloc {200 * MIB}"))
    node.backstop_rounds(2)  # the backstop has looked at the attacker twice since
    assert not marker.exists(), "a script the container named ran on the host"


def test_a_memsize_written_live_reaches_new_processes_and_leaves_what_is_held(
    node: Node
) -> None:
    """Attack 7 (cGPU): `echo N > <tree>/0/<ctr>/memsize` while the container holds memory;
    a new process sees N and is refused past it; what is held stays."""
    node.start_daemon()
    container = node.container(cgpu_mem(1024))
    holder = container.proc()
    assert holder.ask(f"alloc {600 * MIB}") == "alloc rc=0"

    lower_memsize(node, container, 800 * MIB)
    newer = container.proc()
    assert fields(newer.ask("info")) == {"free": str(200 * MIB), "total": str(800 * MIB),
                                         "rc": "0"}
    assert fields(newer.ask("nvml"))["total"] == str(800 * MIB)
    assert newer.ask(f"alloc {250 * MIB}") == "alloc rc=2"  # out of memory, not a SIGKILL
    assert newer.ask(f"alloc {200 * MIB}") == "alloc rc=0"
    assert newer.ask("alloc 1") == "alloc rc=2"

    lower_memsize(node, container, 512 * MIB)  # below the 800 MiB held
    third = container.proc()
    assert fields(third.ask("info")) == {"free": "0", "total": str(512 * MIB), "rc": "0"}
    assert fields(third.ask("nvml"))["total"] == str(512 * MIB)
    assert third.ask("alloc 1") == "alloc rc=2"
    held = {holder.host_pid: 600 * MIB, newer.host_pid: 200 * MIB, third.host_pid: 0}
    wait_for(lambda: node.meminfo(container) == (0, held), 3, "meminfo with what each holds")
    node.backstop_rounds(3)
    assert holder.alive()
    assert newer.alive()
    assert holder.ask("alloc 1") == "alloc rc=2"
    assert not over_limit_logged(node, container)
