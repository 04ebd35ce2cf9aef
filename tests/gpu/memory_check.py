"""The memory probe of the validation: run under `cgpu-run --memsize L`.

    python3 memory_check.py torch|driver STATUS_DIR

It reads what the process sees (`torch.cuda.mem_get_info()`, or
`cuMemGetInfo` with the driver backend), what NVML and `nvidia-smi` show
from inside (same preload, same region), then allocates the free memory
less 64 MiB, 32 MiB more (both must succeed), and 64 MiB more (must be out
of memory). It writes `holding.json` in STATUS_DIR, keeps its memory until
`release` appears there (the coordinator compares the daemon's `meminfo`
with NVML meanwhile), and exits.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 1 << 20
HOLD_TIMEOUT = 120.0


class TorchBackend:
    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.held: list[Any] = []
        torch.zeros(1, device="cuda")  # create the context

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self.torch.cuda.mem_get_info()
        return int(free), int(total)

    def alloc(self, size: int) -> str:
        try:
            self.held.append(self.torch.empty(size, dtype=self.torch.uint8, device="cuda"))
        except self.torch.cuda.OutOfMemoryError:
            return "OOM"
        return "ok"

    def extra(self) -> dict[str, int]:
        return {"torch_reserved": int(self.torch.cuda.memory_reserved())}


class DriverBackend:
    """The driver API through ctypes (simgpu in the simulated run)."""

    def __init__(self) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        device, context = ctypes.c_int(), ctypes.c_void_p()
        steps: tuple[tuple[str, Callable[[], int]], ...] = (
            ("cuInit", lambda: self.cuda.cuInit(0)),
            ("cuDeviceGet", lambda: self.cuda.cuDeviceGet(ctypes.byref(device), 0)),
            ("cuDevicePrimaryCtxRetain",
             lambda: self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)),
            ("cuCtxSetCurrent", lambda: self.cuda.cuCtxSetCurrent(context)),
        )
        for name, rc in steps:
            result = rc()
            if result != 0:
                raise RuntimeError(f"{name} failed: CUresult {result}")
        self.held: list[int] = []

    def mem_get_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        rc = self.cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        if rc != 0:
            raise RuntimeError(f"cuMemGetInfo failed: CUresult {rc}")
        return free.value, total.value

    def alloc(self, size: int) -> str:
        pointer = ctypes.c_uint64()
        rc = self.cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(size))
        if rc == 2:  # CUDA_ERROR_OUT_OF_MEMORY
            return "OOM"
        if rc != 0:
            return f"CUresult {rc}"
        self.held.append(pointer.value)
        return "ok"

    def extra(self) -> dict[str, int]:
        return {}


def nvml_inside() -> dict[str, Any]:
    """NVML's memory info as this process sees it (libcgpu shows the limit)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0]
        handle = (pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid.startswith("GPU-")
                  else pynvml.nvmlDeviceGetHandleByIndex(0))
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return {"total": int(info.total), "used": int(info.used)}
    except Exception as error:
        return {"error": repr(error)}


def nvidia_smi_inside() -> dict[str, Any]:
    """`nvidia-smi`'s memory.total/used in MiB, run with this process's preload and region."""
    if shutil.which("nvidia-smi") is None:
        return {"error": "nvidia-smi not found"}
    target = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    command = ["nvidia-smi", "-i", target, "--query-gpu=memory.total,memory.used",
               "--format=csv,noheader,nounits"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"error": repr(error)}
    try:
        total, used = (int(x) for x in result.stdout.strip().splitlines()[0].split(","))
    except (ValueError, IndexError):
        return {"error": f"rc={result.returncode} {result.stdout.strip()[:200]!r} "
                         f"{result.stderr.strip()[:200]!r}"}
    return {"total_mib": total, "used_mib": used}


def main(backend_name: str, status: Path) -> int:
    makers: dict[str, Callable[[], TorchBackend | DriverBackend]] = {
        "torch": TorchBackend, "driver": DriverBackend}
    backend = makers[backend_name]()
    report: dict[str, Any] = {"pid": os.getpid(), "backend": backend_name}
    free, total = backend.mem_get_info()
    report["mem_get_info"] = {"free": free, "total": total}
    report["nvml_inside"] = nvml_inside()
    report["nvidia_smi_inside"] = nvidia_smi_inside()
    first = max(0, free - 64 * MiB)
    report["alloc"] = [
        {"size": first, "result": backend.alloc(first)},
        {"size": 32 * MiB, "result": backend.alloc(32 * MiB)},
        {"size": 64 * MiB, "result": backend.alloc(64 * MiB)},
    ]
    free_after, _ = backend.mem_get_info()
    report["free_after"] = free_after
    report["nvidia_smi_holding"] = nvidia_smi_inside()
    report.update(backend.extra())
    temporary = status / ".holding.json"
    temporary.write_text(json.dumps(report))
    os.replace(temporary, status / "holding.json")
    deadline = time.monotonic() + HOLD_TIMEOUT
    while not (status / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
