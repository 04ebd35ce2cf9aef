"""Helpers for libcgpu's tests: the built libraries and a sandbox (a private
simgpu state, a region file, runners for workloads under the library)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cgpu_km.dataplane import region as region_mod

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SIMGPU = REPO / "simgpu"
LIBCGPU = REPO / "libcgpu"
UUID = "GPU-6a3f2c10-84b1-4f0e-9d2a-51c7e0b4a9d3"
DEVICE_TOTAL = 15109 << 20


def start_time(pid: int) -> int | None:
    """A running process's start time (field 22 of stat); None when gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def local_alive(view: region_mod.ProcView) -> bool:
    """Whether a slot's process runs, in this (the tests') pid namespace."""
    return start_time(view.pid) == view.start_time


def wait_in_syscall(pid: int, tid: int, number: int, what: str, timeout: float = 10,
                    running: Callable[[], bool] = lambda: True) -> None:
    """Wait until thread `tid` of `pid` sleeps in syscall `number` (as /proc shows it):
    the event of a thread being parked there, where a sleep would only be a time in
    which it was not yet woken. AssertionError once `running()` is false, or after
    `timeout` (a hang guard)."""
    syscall = Path(f"/proc/{pid}/task/{tid}/syscall")
    deadline = time.monotonic() + timeout
    while syscall.read_text().split()[:1] != [str(number)]:
        assert running(), f"{what}: it went on instead"
        assert time.monotonic() < deadline, f"{what}: it never went to sleep"
        time.sleep(0.01)


@dataclass(frozen=True)
class Built:
    libcgpu: Path
    simgpu_dir: Path
    workload: Path


def build(out_dir: Path) -> Built:
    """Make simgpu and libcgpu, and compile the C workload into `out_dir`
    (subprocess.CalledProcessError, with the compiler's output, if one fails)."""
    for directory in (SIMGPU, LIBCGPU):
        subprocess.run(["make", "-s", "-C", str(directory)], check=True, capture_output=True,
                       text=True)
    out = out_dir / "workload"
    subprocess.run(
        ["gcc", "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{LIBCGPU / 'include'}",
         "-o", str(out), str(HERE / "workload.c"), str(SIMGPU / "libcuda.so.1"), "-ldl"],
        check=True, capture_output=True, text=True)
    return Built(libcgpu=LIBCGPU / "libcgpu.so", simgpu_dir=SIMGPU, workload=out)


class Sandbox:
    """A private simulated GPU and one container region, with workload runners."""

    def __init__(self, built: Built, tmp: Path) -> None:
        self.built = built
        self.tmp = tmp
        self.region_path = tmp / "ctr"
        self.region: region_mod.Region | None = None
        self.base_env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LD_LIBRARY_PATH": str(built.simgpu_dir),
            "SIMGPU_STATE": str(tmp / "simgpu-state"),
            "SIMGPU_DEVICES": f"Tesla T4:15109MiB:{UUID}",
            "SIMGPU_CONTEXT_MEM": "0",
            "PYTHONPATH": str(REPO),
        }
        self._beat: threading.Thread | None = None
        self._beating = threading.Event()

    def make_region(self, limit: int, *, mode: str = "cgpu", uuid: str = UUID,
                    ctx_bytes: int = 0, oom_script: str = "",
                    gate_timeout_ns: int = region_mod.DEFAULT_GATE_TIMEOUT_NS,
                    gates_open: bool = True) -> region_mod.Region:
        """The container's region; its gates open (no daemon here) unless asked."""
        self.region = region_mod.Region.create(
            self.region_path, "ctr-test", [region_mod.GpuSpec(limit, uuid, 0, ctx_bytes)],
            mode=mode, oom_script=oom_script, gate_timeout_ns=gate_timeout_ns,
            gates_open=gates_open)
        return self.region

    def env(self, *, preload: bool = True, region: bool = True, **extra: str) -> dict[str, str]:
        env = dict(self.base_env)
        if preload:
            env["LD_PRELOAD"] = str(self.built.libcgpu)
        if region:
            env["CGPU_REGION"] = str(self.region_path)
        env.update(extra)
        return env

    def workload(self, *ops: str, getproc: bool = False, timeout: float = 30,
                 preload: bool = True, region: bool = True) -> subprocess.CompletedProcess[str]:
        args = [str(self.built.workload), *(["--getproc"] if getproc else []), *ops]
        return subprocess.run(args, env=self.env(preload=preload, region=region),
                              capture_output=True, text=True, timeout=timeout)

    def popen(self, args: list[str], *, preload: bool = True, region: bool = True,
              **extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(args, env=self.env(preload=preload, region=region, **extra),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def python(self, script: str, *args: str, timeout: float = 30,
               preload: bool = True, region: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", script, *args],
                              env=self.env(preload=preload, region=region),
                              capture_output=True, text=True, timeout=timeout)

    def ctypes_workload(self, *ops: str, timeout: float = 30, preload: bool = True,
                        region: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(HERE / "ctypes_workload.py"), *ops],
                              env=self.env(preload=preload, region=region),
                              capture_output=True, text=True, timeout=timeout)

    def start_heartbeat(self, period: float = 0.05) -> None:
        """Act as a live daemon: stamp the heartbeat until stop_heartbeat()."""
        region = self.region
        assert region is not None
        self._beating.set()

        def beat() -> None:
            while self._beating.is_set():
                region.heartbeat()
                time.sleep(period)

        self._beat = threading.Thread(target=beat, daemon=True)
        self._beat.start()

    def stop_heartbeat(self) -> None:
        self._beating.clear()
        if self._beat is not None:
            self._beat.join()
            self._beat = None

    @staticmethod
    def rcs(output: str) -> list[tuple[str, int]]:
        """(op, rc) of each workload line that reports a result code."""
        result = []
        for line in output.splitlines():
            if "rc=" in line:
                op = line.split()[0]
                result.append((op, int(line.rsplit("rc=", 1)[1].split()[0])))
        return result

    def close(self) -> None:
        self.stop_heartbeat()
        if self.region is not None:
            self.region.close()


