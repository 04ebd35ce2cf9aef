"""A whole node on simgpu for measured tests and the benchmark.

A private simgpu state, the control tree (given), one region per container,
`cuworkload` processes under libcgpu, the real `cgpu-daemon`, and an
independent meter: a subprocess that integrates simgpu's NVML process
utilization in short windows (`python -m tests.daemon.simbox meter ...`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cgpu_km import region as region_mod
from cgpu_km import treefs

REPO = Path(__file__).resolve().parents[2]
SIMGPU = REPO / "simgpu"
LIBCGPU = REPO / "libcgpu" / "libcgpu.so"
WORKLOAD = SIMGPU / "cuworkload"
UUID = "GPU-5e1f3a2b-0c4d-4e6f-8a9b-7c1d2e3f4a5b"
VENV_BIN = Path(sys.executable).parent


def missing() -> str | None:
    """Why the simgpu node cannot run here, or None."""
    for path in (SIMGPU / "libcuda.so.1", SIMGPU / "libnvidia-ml.so.1", WORKLOAD, LIBCGPU):
        if not path.exists():
            return f"{path.relative_to(REPO)} is not built (make build)"
    return None


class SimNode:
    """One simulated host: `gpus` simulated T4s, containers, workloads, the daemon."""

    def __init__(self, tmp: Path, root: Path, *, gpus: int = 1,
                 queue_depth: int | None = None) -> None:
        """`queue_depth`: simgpu's launch queue per stream (None: its default, 1024;
        libcgpu's in-flight bound keeps what each process queues short)."""
        self.tmp = tmp
        self.root = root
        self.region_dir = tmp / "regions"
        self.state_dir = tmp / "daemon"
        self.regions: dict[str, region_mod.Region] = {}
        self.workloads: dict[str, list[subprocess.Popen[bytes]]] = {}
        self.daemon: subprocess.Popen[bytes] | None = None
        devices = ",".join(
            f"Tesla T4:15109MiB:{UUID[:-2]}{i:02d}" for i in range(gpus)
        )
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LD_LIBRARY_PATH": str(SIMGPU),
            "SIMGPU_STATE": str(tmp / "simgpu-state"),
            "SIMGPU_DEVICES": devices,
            "SIMGPU_CONTEXT_MEM": "0",
            "CGPU_SIMULATE": "1",
            "CGPU_SIMGPU_DIR": str(SIMGPU),
            "PYTHONPATH": str(REPO),
        }
        if queue_depth is not None:
            self.env["SIMGPU_QUEUE_DEPTH"] = str(queue_depth)

    def uuid(self, gpu: int) -> str:
        return f"{UUID[:-2]}{gpu:02d}"

    def add(self, name: str, gpu: int = 0, **params: int) -> None:
        """Register a container (`add` through inst_ctl) and create its region."""
        extra = " ".join(f"{k}={v}" for k, v in params.items())
        treefs.inst_ctl(self.root, f"add {gpu} {name} {extra}".rstrip())
        self.regions[name] = region_mod.Region.create(
            region_mod.region_path(name, self.region_dir), name,
            [region_mod.GpuSpec(params.get("memsize", 0), self.uuid(gpu), gpu, 0)],
        )

    def start(self, name: str, procs: int = 1, us: int = 1000) -> None:
        """`procs` processes of container `name`, each launching `us`-microsecond kernels."""
        env = {**self.env, "LD_PRELOAD": str(LIBCGPU),
               "CGPU_REGION": str(region_mod.region_path(name, self.region_dir))}
        gpu = self.regions[name].gpu_spec(0).host_index
        for _ in range(procs):
            self.workloads.setdefault(name, []).append(subprocess.Popen(
                [str(WORKLOAD), "--device", str(gpu), "--stream", "--kernels", "100000000",
                 "--us", str(us)],
                env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))

    def stop(self, name: str) -> None:
        for proc in self.workloads.pop(name, []):
            proc.kill()
            proc.wait()

    def start_daemon(self, period: float = 0.02, *extra: str) -> None:
        (self.state_dir / "snapshot.json").unlink(missing_ok=True)
        with (self.tmp / "daemon.log").open("ab") as log:
            self.daemon = subprocess.Popen(
                [str(VENV_BIN / "cgpu-daemon"), "--root", str(self.root), "--state-dir",
                 str(self.state_dir), "--region-dir", str(self.region_dir), "--period",
                 str(period), *extra],
                env=self.env, stdout=log, stderr=log,
            )
        deadline = time.monotonic() + 30
        snapshot = self.state_dir / "snapshot.json"
        while not snapshot.exists():
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cgpu-daemon did not start: {self.daemon_log()}")
            time.sleep(0.05)

    def daemon_log(self) -> str:
        path = self.tmp / "daemon.log"
        return path.read_text() if path.exists() else ""

    def kill_daemon(self, sig: int = signal.SIGKILL) -> None:
        if self.daemon is not None:
            self.daemon.send_signal(sig)
            self.daemon.wait(timeout=30)
            self.daemon = None

    def measure(self, seconds: float, gpu: int = 0) -> dict[str, float]:
        """Share of GPU time per container over the next `seconds` (independent meter)."""
        result = subprocess.run(
            [sys.executable, "-m", "tests.daemon.simbox", "meter", str(seconds), str(gpu)],
            env=self.env, capture_output=True, text=True, timeout=seconds + 60, check=True,
            cwd=REPO,
        )
        busy = {int(pid): value for pid, value in json.loads(result.stdout).items()}
        shares = {}
        for name, procs in self.workloads.items():
            shares[name] = sum(busy.get(p.pid, 0.0) for p in procs) / seconds
        return shares

    def daemon_cpu_seconds(self) -> float:
        """user+system CPU time the running daemon has used so far."""
        assert self.daemon is not None
        fields = Path(f"/proc/{self.daemon.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self, unregister: bool = False) -> None:
        for name in list(self.workloads):
            self.stop(name)
        if self.daemon is not None and self.daemon.poll() is None:
            self.kill_daemon(signal.SIGTERM)
        for name, region in self.regions.items():
            region.close()
            if unregister:
                treefs.inst_ctl(self.root, f"del {name}")
                region_mod.Region.remove(region.path)
        self.regions.clear()


def meter(seconds: float, gpu: int, window: float = 0.1) -> dict[int, float]:
    """GPU busy seconds per pid over `seconds`, from simgpu's NVML in `window` steps."""
    import pynvml

    from cgpu_km.gpus import load_simgpu

    load_simgpu()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    busy: dict[int, float] = {}

    def read(last: int) -> int:
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(handle, last)
        except pynvml.NVMLError:
            return last
        stamp = last
        for sample in samples:
            stamp = max(stamp, int(sample.timeStamp))
            if last:
                share = int(sample.smUtil) / 100.0
                busy[int(sample.pid)] = busy.get(int(sample.pid), 0.0) + share * (
                    int(sample.timeStamp) - last) / 1e6
        return stamp

    last = read(0)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(window, max(0.0, end - time.monotonic())))
        last = read(last)
    return busy


if __name__ == "__main__":
    if sys.argv[1:2] == ["meter"]:
        print(json.dumps(meter(float(sys.argv[2]), int(sys.argv[3]))))
