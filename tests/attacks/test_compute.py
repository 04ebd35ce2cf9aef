"""Issue 36, item 1, against the real daemon and runc containers: GPU time taken past
the gate by a process that keeps libcgpu loaded is seen from the driver's side and
stopped.

The attacker is `rawlaunch.c`, preloaded (LD_PRELOAD, which the loader reads before
the container's /etc/ld.so.preload) into one of a container's two sharework
workloads: it reads the driver's cuLaunchKernel from libcuda's own symbol table and
launches there, past the gate, with its slot, its memory limit and libcgpu all in
place. The daemon reads NVML's per-process samples as if NVML read every process at
0.7 of what it ran (SIMGPU_NVML_PROC_BIAS, the low end of what simgpu draws), the
hardest case for the check; the shares are counted in the workloads.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cgpu_km.daemon.snapshot import SNAPSHOT_NAME, read_snapshot
from tests.attacks.node import RAW, Container, Node, ShareJob, image_with, missing, sharing

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing()))]

US = 1000  # 1 ms kernels
SECONDS = 6.0
STOPPING = re.compile(r"container (\S+) on GPU 0 used .* s of GPU time .*: pid (\d+) "
                      r"(stopping it|reported only)")


@pytest.fixture
def low_reading(node: Node) -> Node:
    node.sim.env["SIMGPU_NVML_PROC_BIAS"] = "0.7"
    return node


def verdicts(node: Node) -> list[tuple[str, int, str]]:
    """The compute check's journal lines: (container, host pid, what was done)."""
    return [(m[1], int(m[2]), m[3]) for m in STOPPING.finditer(node.sim.daemon_log())]


def run_attack(node: Node, rawlaunch: Path, attacked_env: dict[str, str]
               ) -> tuple[Container, Container, dict[str, int | None]]:
    """Two containers at 1:1 under policy 1; `a` runs an honest workload and the
    attacker, `b` an honest one. What each completed (None: it did not finish)."""
    a = node.container(attacked_env, image=image_with(rawlaunch))
    b = node.container({"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "ALIYUN_COM_GPU_MEM_DEV": "15"})
    jobs = {"a": ShareJob(a, US, SECONDS), "raw": ShareJob(a, US, SECONDS, env=RAW),
            "b": ShareJob(b, US, SECONDS)}
    with sharing(list(jobs.values())):
        pass
    done: dict[str, int | None] = {}
    for name, job in jobs.items():
        try:
            done[name] = job.report(timeout=SECONDS + 60).kernels
        except AssertionError:
            done[name] = None  # stopped
    return a, b, done


CGPU_A = {"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "ALIYUN_COM_GPU_MEM_DEV": "15"}


def test_the_attack_takes_more_than_its_share_where_it_is_only_reported(
        low_reading: Node, rawlaunch: Path) -> None:
    """Report-only: the simulator shows the attack. Container `a` (a half) takes
    well over half of what both completed, and the check names the attacker."""
    node = low_reading
    node.start_daemon("--on-bypass", "report")
    a, _b, done = run_attack(node, rawlaunch, CGPU_A)
    counts = {name: n for name, n in done.items() if n is not None}
    assert len(counts) == len(done), done
    got = (counts["a"] + counts["raw"]) / sum(counts.values())
    print(f"report only: container a completed {got:.3f} of the kernels (allowed 0.50)")
    assert got > 0.6
    found = verdicts(node)
    assert found, node.sim.daemon_log()
    assert {(name, action) for name, _pid, action in found} == {(a.id12, "reported only")}
    assert len({pid for _name, pid, _action in found}) == 1  # one process, the attacker's


@pytest.mark.parametrize("cap", [None, 10], ids=["one-to-one", "capped-at-10"])
def test_the_process_that_launches_past_the_gate_is_stopped(
        low_reading: Node, rawlaunch: Path, cap: int | None) -> None:
    """The attacker is stopped; its neighbour in the same container and the other
    container finish their runs untouched."""
    node = low_reading
    node.start_daemon()
    env = dict(CGPU_A)
    if cap is not None:
        env["GPU_UTIL_PER_DEVICE"] = str(cap)
    a, _b, done = run_attack(node, rawlaunch, env)
    log = node.sim.daemon_log()
    assert done["raw"] is None, (done, log)
    assert done["a"] is not None, log
    assert done["b"] is not None, log
    found = verdicts(node)
    assert len(found) == 1, log
    assert found[0][0] == a.id12
    assert found[0][2] == "stopping it"


@pytest.fixture
def high_reading(node: Node) -> Node:
    node.sim.env["SIMGPU_NVML_PROC_BIAS"] = "1.4"
    return node


@pytest.mark.parametrize("us", [50, 1000, 20000])
def test_honest_containers_read_high_are_never_stopped(high_reading: Node, us: int) -> None:
    """Three busy containers, one capped, every process read at 1.4 times what it ran
    (the top of simgpu's range), audited every second: the check judges nothing."""
    node = high_reading
    node.start_daemon("--audit-every", "1")
    envs = [dict(CGPU_A), {**CGPU_A, "ALIYUN_COM_GPU_SCHD_WEIGHT": "2"},
            {**CGPU_A, "GPU_UTIL_PER_DEVICE": "20"}]
    node.echo("0/policy", 2)
    jobs = [ShareJob(node.container(env), us, SECONDS) for env in envs]
    with sharing(jobs):
        pass
    for job in jobs:
        assert job.report(timeout=SECONDS + 60).kernels > 0
    assert verdicts(node) == [], node.sim.daemon_log()
    snapshot = read_snapshot(node.state_dir / SNAPSHOT_NAME)
    assert snapshot is not None
    audited = [c.audits for c in snapshot.containers if c.gpu == 0 and c.weight > 0]
    print(f"audits: {audited}")
    assert sum(audited) >= 1  # they were looked at, in quiet spans, and passed
