"""Attacks on what the containers report: process slots, and processes without libcgpu.

Issue 13, attacks 4, 9 and 10, and a bypass of libcgpu: each with the real
daemon (its backstop reads NVML's host pids and asks the kernel which
container each is in) and containers under real runc.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable

import pytest

from cgpu_km.dataplane import futex, kernelview
from tests.attacks.node import (
    MIB,
    VENV_BIN,
    Container,
    Node,
    Proc,
    fields,
    missing,
    wait_for,
)
from tests.libcgpu.sandbox import wait_in_syscall

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing()))]

GIB = 1 << 30
STOPPED = 128 + signal.SIGKILL  # what `runc exec` returns for a process killed by SIGKILL
# The backstop reads NVML every 0.5 s; a stop takes that plus NVML's and the kernel's answers.
BACKSTOP_WINDOW = 3.0


def cgpu_mem(mib: int) -> dict[str, str]:
    """A cGPU container's environment for a limit of `mib` MiB on the simulated T4."""
    return {"ALIYUN_COM_GPU_MEM_CONTAINER": str(mib), "ALIYUN_COM_GPU_MEM_DEV": "15109"}


def over_limit_logged(node: Node, container: Container) -> bool:
    return f"container {container.id12} on GPU 0 holds" in node.sim.daemon_log()


def stopped_or_refused(proc: Proc, answer: str) -> None:
    """An allocation past the limit is refused, or the backstop stops the process soon."""
    if answer == "alloc rc=2":
        return
    assert answer == "alloc rc=0", answer
    assert proc.wait(BACKSTOP_WINDOW) == STOPPED, "the backstop did not stop the process"


def test_a_process_that_rewrites_its_slot_is_still_counted_and_stopped(node: Node) -> None:
    """Attack 4(a): a process holding GPU memory rewrites its own slot (pid 1, a made-up pid
    namespace, nothing held). It is counted by its host pid all the same, and since it no
    longer has a slot of its own, it is stopped as a process that bypassed libcgpu; a
    container that only reports bypasses has its allocation past the limit refused by
    what the daemon saw it hold, or the process stopped by the backstop."""
    container = node.container(cgpu_mem(512))
    node.start_daemon()
    attacker = container.proc()
    assert attacker.ask(f"alloc {300 * MIB}") == "alloc rc=0"
    assert attacker.ask("forge-own 1 4026539999 0") == "forge-own ok"
    assert attacker.wait(BACKSTOP_WINDOW * 10) == STOPPED
    assert "holds GPU memory without libcgpu (not scheduled): stopping it" in \
        node.sim.daemon_log()
    assert attacker.host_pid not in node.nvml_processes()


def test_a_process_that_rewrites_its_slot_cannot_allocate_past_the_limit(node: Node) -> None:
    """Attack 4(a) where bypasses are only reported: the rewritten slot says nothing is
    held, but the process's own count (in its private memory) and what the daemon saw
    say 300 MiB."""
    container = node.container(cgpu_mem(512))
    node.start_daemon("--report-bypass", container.id12)
    attacker = container.proc()
    assert attacker.ask(f"alloc {300 * MIB}") == "alloc rc=0"
    assert attacker.ask("forge-own 1 4026539999 0") == "forge-own ok"
    wait_for(lambda: node.meminfo(container) == (212 * MIB, {attacker.host_pid: 300 * MIB}), 3,
             "meminfo listing the process by its host pid")
    assert attacker.ask(f"alloc {300 * MIB}") == "alloc rc=2"
    assert attacker.alive()
    assert node.nvml_processes()[attacker.host_pid] == 300 * MIB


def test_a_process_named_in_bytes_that_are_not_utf8_is_still_seen(node: Node) -> None:
    """Any process may name itself with any bytes (prctl PR_SET_NAME), and the kernel
    shows them in its /proc stat and status: here 0xff ) 0xfe (, not UTF-8, with
    parentheses to mislead a parser of stat. The daemon still finds the process: its
    slot is not freed as a dead process's, NVML's figure for it is still its
    container's, and another process of the container cannot allocate past the
    limit."""
    container = node.container(cgpu_mem(512))
    node.start_daemon()
    attacker = container.proc()
    assert attacker.ask(f"alloc {300 * MIB}") == "alloc rc=0"
    assert attacker.ask("rename ff29fe28") == "rename ok"
    node.backstop_rounds(4)  # two seconds: the slots' processes were looked up since
    assert fields(attacker.ask("slot"))["mem"] == str(300 * MIB), "its slot was kept"
    assert node.meminfo(container) == (212 * MIB, {attacker.host_pid: 300 * MIB})
    assert container.proc().ask(f"alloc {300 * MIB}") == "alloc rc=2"
    assert attacker.alive()


def test_a_forged_slot_naming_a_neighbour_stops_nobody(node: Node) -> None:
    """Attack 4(b): a container that uses no GPU writes slots naming another container's
    process (by host pid, and by its pid namespace and pid), far over its own limit."""
    node.start_daemon()
    victim_container = node.container(cgpu_mem(512))
    victim = victim_container.proc()
    assert victim.ask(f"alloc {300 * MIB}") == "alloc rc=0"
    forger_container = node.container(cgpu_mem(64), user=0)
    forger = forger_container.proc()
    info = kernelview.process_info(victim.host_pid)
    assert info is not None
    host_ns = os.stat("/proc/self/ns/pid").st_ino
    assert forger.ask(f"forge 0 {victim.host_pid} {host_ns} {info.start_time} {10 * GIB}") == \
        "forge ok"
    assert forger.ask(f"forge 1 {victim.pid} {victim_container.pidns()} {info.start_time} "
                      f"{10 * GIB}") == "forge ok"
    forged = forger_container.region()
    assert len(forged.processes()) == 2
    wait_for(lambda: forged.processes() == [], 3, "the daemon freeing the forged slots")
    forged.close()
    node.backstop_rounds(2)
    assert victim.alive()
    assert forger.alive()
    assert victim.ask("alloc 1") == "alloc rc=0"
    assert node.meminfo(forger_container) == (64 * MIB, {})
    wait_for(lambda: node.meminfo(victim_container)[1] == {victim.host_pid: 300 * MIB + 1}, 3,
             "the victim's own meminfo")
    assert "over its limit" not in node.sim.daemon_log()


def smi_pids(node: Node) -> set[int]:
    """The pids that `cgpu-smi --json` shows on GPU 0."""
    out = subprocess.run([str(VENV_BIN / "cgpu-smi"), "--json", "--root", str(node.tree),
                          "--state-dir", str(node.state_dir)], env=node.env,
                         capture_output=True, text=True, timeout=30, check=True).stdout
    view = json.loads(out)
    return {p["pid"] for c in view["gpus"][0]["containers"] for p in c["processes"]}


def test_a_process_killed_at_the_gate_is_reclaimed_by_a_scan(node: Node) -> None:
    """Attack 9: a process SIGKILLed while it waits at a closed gate, holding memory."""
    node.echo("0/policy", 3)  # fixed shares: a container of weight 0 never gets the GPU
    node.start_daemon()
    container = node.container(cgpu_mem(512))
    node.echo(f"0/{container.id12}/weight", 0)
    region = container.region()
    waiter = container.proc()
    assert waiter.ask(f"alloc {100 * MIB}") == "alloc rc=0"
    waiter.send("launch 1 1000")
    wait_for(lambda: region.activity(0).pending == 1, 3, "the launch waiting at the gate")
    # held: its thread sleeps in libcgpu's FUTEX_WAIT on the gate word
    wait_in_syscall(waiter.host_pid, waiter.host_pid, futex._SYS_FUTEX,
                    "the launch at a closed gate", running=waiter.alive)
    assert region.usage(0) == 100 * MIB
    wait_for(lambda: waiter.host_pid in smi_pids(node), 5, "cgpu-smi showing the process")

    os.kill(waiter.host_pid, signal.SIGKILL)
    took = wait_for(lambda: region.processes() == [], 10, "the daemon reclaiming the slot")
    print(f"the slot was reclaimed {took:.2f} s after SIGKILL (a scan every second)")
    assert (region.usage(0), region.activity(0).pending) == (0, 0)
    wait_for(lambda: waiter.host_pid not in smi_pids(node), 5, "cgpu-smi dropping the process")
    assert waiter.wait(5) == STOPPED
    region.close()


def test_the_context_charge_is_measured_and_a_process_at_its_limit_is_not_stopped(
    make_node: Callable[..., Node]
) -> None:
    """Attack 10: the context's memory is charged as measured (simgpu's 300 MiB), so a
    process exactly at its limit is within it for the backstop too."""
    node = make_node(context_mem="300MiB")
    node.start_daemon()
    container = node.container(cgpu_mem(1024))
    proc = container.proc()
    assert proc.ask(f"alloc {724 * MIB}") == "alloc rc=0"
    slot = fields(proc.ask("slot"))
    assert slot["ctx_bytes"] == str(300 * MIB)
    assert proc.ask("alloc 1") == "alloc rc=2"
    assert node.nvml_processes()[proc.host_pid] == 1024 * MIB  # exactly the limit
    wait_for(lambda: node.meminfo(container) == (0, {proc.host_pid: 1024 * MIB}), 3,
             "meminfo showing the process at its limit")
    node.backstop_rounds(3)
    assert proc.alive()
    assert proc.ask("info") == f"info free=0 total={1024 * MIB} rc=0"
    assert not over_limit_logged(node, container)
