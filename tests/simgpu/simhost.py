"""A simulated host for simgpu tests: snippets and `cuworkload` processes on simgpu.

Both libraries attach to their shared state once per process, so every
scenario runs in fresh subprocesses: Python snippets driving `libcuda.so.1`
with ctypes or `pynvml` (unmodified, with simgpu's NVML loaded first), and
the `cuworkload` C program for long-lived or concurrent workloads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Prepended to every snippet: ctypes bindings and small helpers.
PREAMBLE = textwrap.dedent(
    """
    import ctypes, json, os, sys, time
    LIB = os.environ["SIMGPU_LIB_DIR"]
    cu = ctypes.CDLL(os.path.join(LIB, "libcuda.so.1"))
    u64 = ctypes.c_uint64

    def ok(rc, what="call"):
        if rc != 0:
            raise SystemExit(f"{what} failed with CUresult {rc}")

    def ctx(dev=0):
        ok(cu.cuInit(0), "cuInit")
        c = ctypes.c_void_p()
        ok(cu.cuCtxCreate_v2(ctypes.byref(c), 0, dev), "cuCtxCreate_v2")
        return c

    def mem_info():
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        ok(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
        return free.value, total.value

    def nvml():
        ctypes.CDLL(os.path.join(LIB, "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)
        import pynvml
        pynvml.nvmlInit()
        return pynvml

    def out(value):
        print(json.dumps(value), flush=True)

    def kernel(us):
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        ok(cu.cuModuleLoadData(ctypes.byref(mod), b"simgpu"), "cuModuleLoadData")
        ok(cu.cuModuleGetFunction(ctypes.byref(fn), mod, f"sleep_{us}".encode()),
           "cuModuleGetFunction")
        return fn

    def launch(fn, stream=None):
        ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, None, None), "cuLaunchKernel")

    def record(stream=None):
        e = ctypes.c_void_p()
        ok(cu.cuEventCreate(ctypes.byref(e), 0), "cuEventCreate")
        ok(cu.cuEventRecord(e, stream), "cuEventRecord")
        return e

    def elapsed_ms(a, b):
        ms = ctypes.c_float()
        ok(cu.cuEventElapsedTime(ctypes.byref(ms), a, b), "cuEventElapsedTime")
        return ms.value

    # Run work(role, barrier) in a forked child (role 0) and here (role 1), each
    # its own simgpu process (it forks before cuInit); barrier() meets the
    # other. Returns [the child's result, this one's].
    def duo(work):
        import tempfile
        up_r, up_w = os.pipe()
        down_r, down_w = os.pipe()
        fd, result_file = tempfile.mkstemp(prefix="simgpu-duo-")
        os.close(fd)
        pid = os.fork()
        role = 0 if pid == 0 else 1
        for fd in ((up_r, down_w) if role == 0 else (up_w, down_r)):
            os.close(fd)

        def barrier():
            if role == 0:
                os.write(up_w, b"r")
                if os.read(down_r, 1) != b"g":
                    os._exit(3)
            else:
                if os.read(up_r, 1) != b"r":
                    raise SystemExit("duo: the child died")
                os.write(down_w, b"g")

        if role == 0:
            rc = 1
            try:
                with open(result_file, "w") as f:
                    json.dump(work(0, barrier), f)
                rc = 0
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        mine = work(1, barrier)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise SystemExit(f"duo: the child failed ({status})")
        with open(result_file) as f:
            theirs = json.load(f)
        os.unlink(result_file)
        return [theirs, mine]
    """
)


@dataclass
class Workload:
    """A running `cuworkload` process."""

    process: subprocess.Popen[str]
    ready: dict[str, int] = field(default_factory=dict)

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def read_line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"cuworkload exited early (rc={self.process.wait()})")
        return line.strip()

    def finish(self) -> str:
        out, _ = self.process.communicate(timeout=60)
        return out


@dataclass
class SimHost:
    """One simulated host: its own state file and device list."""

    state: Path
    devices: str
    lib_dir: Path
    workloads: list[Workload] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            SIMGPU_STATE=str(self.state),
            SIMGPU_DEVICES=self.devices,
            SIMGPU_LIB_DIR=str(self.lib_dir),
        )
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.pop("SIMGPU_VISIBLE_DEVICES", None)
        env.update(extra)
        return env

    def run(
        self, code: str, *, check: bool = True, wrap: Sequence[str] = (), **extra: str
    ) -> subprocess.CompletedProcess[str]:
        """Run a snippet (under the `wrap` command line, e.g. unshare)."""
        proc = subprocess.run(
            [*wrap, sys.executable, "-c", PREAMBLE + textwrap.dedent(code)],
            env=self.env(**extra), capture_output=True, text=True, timeout=60, check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"snippet failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def result(self, code: str, *, wrap: Sequence[str] = (), **extra: str) -> Any:
        """Run a snippet and return the JSON it printed last."""
        lines = self.run(code, check=True, wrap=wrap, **extra).stdout.strip().splitlines()
        return json.loads(lines[-1])

    def start(self, *args: str, wrap: Sequence[str] = (), **extra: str) -> Workload:
        """Start cuworkload and wait for its "ready" line."""
        proc = subprocess.Popen(
            [*wrap, str(self.lib_dir / "cuworkload"), *args], env=self.env(**extra),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        work = Workload(proc)
        self.workloads.append(work)
        while True:
            line = work.read_line()
            if line.startswith("ready "):
                work.ready = {k: int(v) for k, v in (kv.split("=") for kv in line.split()[1:])}
                return work

    def stop_all(self) -> None:
        for work in self.workloads:
            if work.process.poll() is None:
                work.process.kill()
            work.process.wait()
            for pipe in (work.process.stdin, work.process.stdout):
                if pipe is not None:
                    pipe.close()
