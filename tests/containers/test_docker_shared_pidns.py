"""Issue 36, item 7, under a real dockerd: `docker run --pid=container:X`.

The second container joins the first's pid namespace and has a cgroup of its
own. Both are managed, with their own limits: each one's processes are
counted in its own meminfo and never stopped, whatever order the daemon
meets the two containers in (it mapped a pid namespace to one of them, and
stopped the other's honest processes as ones that bypassed libcgpu).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from cgpu_km import paths
from cgpu_km.container.oci.settings import DEFAULT_PATH
from cgpu_km.dataplane import kernelview
from cgpu_km.demo.dockerd import PrivateDocker
from tests.containers.helpers import (
    CGPU_6_OF_15,
    DEVICES,
    MIB,
    T4,
    VENV_BIN,
    SimHost,
    missing,
    run_detached,
)
from tests.containers.test_docker import running_daemon, wait_for_log

pytestmark = [
    pytest.mark.skipif(missing("dockerd", "containerd", "runc") is not None,
                       reason=f"{missing('dockerd', 'containerd', 'runc')} is not installed "
                              "(apt-get install docker.io)"),
]

GIB = 1 << 30
CGPU_8_OF_15 = ["-e", "ALIYUN_COM_GPU_MEM_CONTAINER=8", "-e", "ALIYUN_COM_GPU_MEM_DEV=15"]


def meminfo(sim: SimHost, name: str) -> dict[int, int]:
    """{host pid: bytes} from a container's meminfo on GPU 0."""
    procs = {}
    for line in (sim.tree / "0" / name / "meminfo").read_text().splitlines():
        words = line.split()
        if words[:1] == ["PID:"]:
            procs[int(words[1])] = int(words[3])
    return procs


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def sizes(sim: SimHost, name: str) -> list[int]:
    return sorted(meminfo(sim, name).values())


def holds(sim: SimHost, name: str, size: int) -> bool:
    return size in sizes(sim, name)


def in_cgroup_of(pid: int, dockerid: str) -> bool:
    """Whether the kernel puts host pid `pid` in a cgroup of the container `dockerid`."""
    info = kernelview.process_info(pid)
    return info is not None and any(dockerid in path for path in info.cgroups.values())


def test_docker_pid_container_each_keeps_its_own(docker: PrivateDocker, sim: SimHost) -> None:
    """Two containers in one pid namespace, 6/15 and 8/15 of a T4, each with 1 GiB and
    2 GiB held through libcgpu, then one more process each (`docker exec`): every
    meminfo wait is a later memory round of the daemon. Each process is in its own
    container's meminfo; no stop, as a bypass or for memory, in the journal or in
    `cgpu-smi`'s counters."""
    with running_daemon(sim) as log:
        first = run_detached(docker, "gpu_pid_a", *CGPU_6_OF_15, "-e",
                             "NVIDIA_VISIBLE_DEVICES=0")
        assert "ready pid=" in wait_for_log(docker, "gpu_pid_a", "ready pid=")
        second = run_detached(docker, "gpu_pid_b", *CGPU_8_OF_15, "-e",
                              "NVIDIA_VISIBLE_DEVICES=0", "--pid=container:gpu_pid_a",
                              command=["sh", "-c", "cuworkload --alloc 2GiB --hold 600"])
        assert "ready pid=" in wait_for_log(docker, "gpu_pid_b", "ready pid=")
        pids = {name: int(docker.check("inspect", "--format", "{{.State.Pid}}", name))
                for name in ("gpu_pid_a", "gpu_pid_b")}
        assert len({Path(f"/proc/{pid}/ns/pid").stat().st_ino for pid in pids.values()}) == 1
        wait_until(lambda: sizes(sim, first) == [GIB], "the first one's process in its meminfo")
        wait_until(lambda: sizes(sim, second) == [2 * GIB],
                   "the second one's process in its meminfo")
        for name, dockerid in (("gpu_pid_b", second), ("gpu_pid_a", first)):
            docker.check("exec", "-d", name, "cuworkload", "--alloc", "64MiB", "--hold", "600")
            wait_until(partial(holds, sim, dockerid, 64 * MIB),
                       f"{name}'s second process in its meminfo")
        assert sizes(sim, first) == [64 * MIB, GIB]
        assert sizes(sim, second) == [64 * MIB, 2 * GIB]
        for dockerid in (first, second):
            assert all(in_cgroup_of(pid, dockerid) for pid in meminfo(sim, dockerid))
        journal = log.read_text()
        assert "without libcgpu" not in journal
        assert "over its limit" not in journal
        for name in ("gpu_pid_a", "gpu_pid_b"):
            state = docker.check("inspect", "--format", "{{.State.Running}}", name)
            assert state.strip() == "true"
        env = {"PATH": DEFAULT_PATH, "CGPU_SIMULATE": "1",
               "CGPU_SIMGPU_DIR": str(paths.simgpu_dir()), "SIMGPU_STATE": str(sim.state),
               "SIMGPU_DEVICES": DEVICES}
        out = subprocess.run([str(VENV_BIN / "cgpu-smi"), "--json", "--root", str(sim.tree),
                              "--state-dir", str(sim.folder / "daemon")], env=env,
                             capture_output=True, text=True, timeout=30, check=True).stdout
        rows = {c["name"]: c for c in json.loads(out)["gpus"][0]["containers"]}
        for dockerid, limit in ((first, T4 * 6 // 15), (second, T4 * 8 // 15)):
            row = rows[dockerid]
            assert (row["bypass_stops"], row["oom_events"]) == (0, 0)
            assert row["memory_limit_bytes"] == limit
            assert all(p["managed"] for p in row["processes"])
