"""End to end on simgpu: the real cgpu-daemon serves /metrics, a real Prometheus scrapes it.

A container registered in a real FUSE tree runs a `cuworkload` process
under libcgpu (its region made as the OCI hook would); the daemon
publishes what it measures; promtool lints the daemon's scrape; Prometheus'
query API returns the running container's memory limit and its GPU time;
cgpu-smi shows the process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cgpu_km.children import stop_child
from cgpu_km.daemon.snapshot import read_snapshot

REPO = Path(__file__).resolve().parents[2]
SIMGPU = REPO / "simgpu"
LIBCGPU = REPO / "libcgpu" / "libcgpu.so"
WORKLOAD = SIMGPU / "cuworkload"
VENV_BIN = Path(sys.executable).parent
UUID = "GPU-0b5e55ed-0000-4000-8000-00000000c0de"
LIMIT = 6337173913  # floor(15109 MiB * 6 / 15): ALIYUN_COM_GPU_MEM_CONTAINER=6, _DEV=15
ALLOC = 256 << 20


class Node:
    """The daemon, one container with a running workload, on a private simgpu."""

    def __init__(self, tmp: Path, root: Path, metrics_port: int) -> None:
        self.tmp = tmp
        self.root = root
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LD_LIBRARY_PATH": str(SIMGPU),
            "SIMGPU_STATE": str(tmp / "simgpu-state"),
            "SIMGPU_DEVICES": f"Tesla T4:15109MiB:{UUID}",
            "CGPU_SIMULATE": "1",
            "CGPU_SIMGPU_DIR": str(SIMGPU),
        }
        self.state_dir = tmp / "daemon"
        self.processes: list[subprocess.Popen[bytes]] = []
        # A container as cgpu-run makes one: registered, its region, its identity.
        self.workload = self._start(
            [str(VENV_BIN / "cgpu-run"), "--root", str(root), "--name", "job1", "--memsize",
             str(LIMIT), "--weight", "2", "--", str(WORKLOAD), "--device", "0", "--alloc",
             str(ALLOC), "--stream", "--kernels", "100000000", "--us", "2000"],
            {"CGPU_REGION_DIR": str(tmp / "regions")})
        self.log = tmp / "daemon.log"
        self.daemon = self._start(
            [str(VENV_BIN / "cgpu-daemon"), "--root", str(root), "--state-dir",
             str(self.state_dir), "--region-dir", str(tmp / "regions"), "--period", "0.02",
             "--metrics-listen", f"127.0.0.1:{metrics_port}"], {}, log=self.log)
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def _start(self, argv: list[str], env: dict[str, str],
               log: Path | None = None) -> subprocess.Popen[bytes]:
        with (log or Path(os.devnull)).open("wb") as out:
            process = subprocess.Popen(argv, env={**self.env, **env}, stdout=out,
                                       stderr=subprocess.STDOUT)
        self.processes.append(process)
        return process

    def wait_for(self, condition: Callable[[], object], what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{what}: daemon log: {self.log.read_text()}")
            time.sleep(0.05)

    def scrape(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as reply:
            return str(reply.read().decode())

    def close(self) -> None:
        for process in reversed(self.processes):
            stop_child(process)


def _missing() -> str | None:
    for path in (SIMGPU / "libcuda.so.1", SIMGPU / "libnvidia-ml.so.1", WORKLOAD, LIBCGPU):
        if not path.exists():
            return f"{path.relative_to(REPO)} is not built (make build)"
    return None


@pytest.fixture
def node(control_tree: Path, tmp_path: Path) -> Iterator[Node]:
    problem = _missing()
    if problem:
        pytest.skip(problem)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    running = Node(tmp_path, control_tree, port)
    try:
        snapshot = running.state_dir / "snapshot.json"
        running.wait_for(snapshot.exists, "no snapshot from the daemon")
        yield running
    finally:
        running.close()


@pytest.mark.parametrize("control_tree", [1], indirect=True)
def test_prometheus_scrapes_the_daemon(node: Node, start_prometheus: Callable[[str], Any],
                                       promtool: str) -> None:
    prometheus = start_prometheus(node.metrics_url.split("/")[2])

    # The daemon's own view first: the workload's memory reaches meminfo and the snapshot.
    def measured() -> bool:
        snap = read_snapshot(node.state_dir / "snapshot.json")
        job = snap.container(0, "job1") if snap else None
        return (job is not None and job.memory_used_bytes >= ALLOC and job.gpu_time_seconds > 0
                and job.utilization > 0.2)  # alone on the GPU: it runs most of the time

    node.wait_for(measured, "the workload's memory, GPU time and utilization never showed")
    lint = subprocess.run([promtool, "check", "metrics"], input=node.scrape(), text=True,
                          capture_output=True, check=False)
    assert (lint.returncode, lint.stdout, lint.stderr) == (0, "", "")

    job = 'container="job1",gpu="0"'
    prometheus.wait_for(lambda: prometheus.vector(
        f"cgpu_container_gpu_time_seconds_total{{{job}}} > 0"), "a scrape of the running job")
    (limit,) = prometheus.vector(f"cgpu_container_memory_limit_bytes{{{job}}}")
    assert float(limit["value"][1]) == LIMIT
    assert limit["metric"]["uuid"] == UUID
    (used,) = prometheus.vector(f"cgpu_container_memory_used_bytes{{{job}}}")
    assert float(used["value"][1]) >= ALLOC
    (info,) = prometheus.vector("cgpu_gpu_info")
    assert (info["metric"]["name"], info["metric"]["uuid"]) == ("Tesla T4", UUID)
    (period,) = prometheus.vector("cgpu_scheduler_period_seconds")
    assert float(period["value"][1]) == 0.02

    smi = subprocess.run(
        [str(VENV_BIN / "cgpu-smi"), "--root", str(node.root), "--state-dir",
         str(node.state_dir)], env=node.env, capture_output=True, text=True, timeout=30,
        check=True).stdout
    assert f"Daemon: running (pid {node.daemon.pid}" in smi
    gpu_pids = [int(line.split()[1]) for line in
                (node.root / "0" / "job1" / "meminfo").read_text().splitlines()
                if line.startswith("PID:")]
    assert len(gpu_pids) == 1, "the job's one GPU process, as the kernel attributes it"
    assert f"| {gpu_pids[0]} |" in smi
