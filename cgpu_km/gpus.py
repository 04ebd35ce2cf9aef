"""GPU discovery through NVML (pynvml), on a real driver or on simgpu.

`discover_gpus()` lists the host's GPUs. With `CGPU_SIMULATE=1`, or when no
NVIDIA driver is present (then it says so in one line on stderr), it loads
simgpu's `libnvidia-ml.so.1` first, globally, so that pynvml's own
`dlopen("libnvidia-ml.so.1")` resolves to it by soname. Every NVML failure
becomes a `GpuError` with a one-line message, never a traceback.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from cgpu_km import paths

SIMULATE_ENV = "CGPU_SIMULATE"
SIMGPU_DIR_ENV = paths.SIMGPU_DIR_ENV
NVML_SONAME = "libnvidia-ml.so.1"
NVIDIA_CONTROL_DEVICE = "/dev/nvidiactl"
_NO_DRIVER = (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED)


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it; `memory_total` is in bytes."""

    index: int
    uuid: str
    name: str
    memory_total: int


class GpuError(RuntimeError):
    """GPU discovery failed; `str(error)` is the one-line message."""


def simgpu_lib_dir() -> Path:
    """Where simgpu's libraries are: $CGPU_SIMGPU_DIR, else `<repo>/simgpu`, else
    the installed prefix's `simgpu/` (cgpu_km.paths)."""
    return paths.simgpu_dir()


def simulate_requested(env: dict[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(SIMULATE_ENV, "") == "1"


def simulating(env: dict[str, str] | None = None) -> bool:
    """Whether GPU programs here run on simgpu: $CGPU_SIMULATE=1, or no NVIDIA
    driver (no /dev/nvidiactl)."""
    return simulate_requested(env) or not os.path.exists(NVIDIA_CONTROL_DEVICE)


def with_simgpu_libraries(env: dict[str, str], folder: Path) -> dict[str, str]:
    """`env` with simgpu's folder first on LD_LIBRARY_PATH, so that a program
    finds its libcuda.so.1 and libnvidia-ml.so.1 by soname, as the driver's."""
    rest = [part for part in env.get("LD_LIBRARY_PATH", "").split(":")
            if part and part != str(folder)]
    return {**env, "LD_LIBRARY_PATH": ":".join([str(folder), *rest])}


def load_simgpu() -> None:
    """Make simgpu's NVML the one pynvml uses (idempotent)."""
    path = simgpu_lib_dir() / NVML_SONAME
    if not path.is_file():
        raise GpuError(f"simgpu NVML library not found at {path} (build it with "
                       f"`make -C simgpu`, or set {SIMGPU_DIR_ENV})")
    try:
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as error:
        raise GpuError(f"cannot load {path}: {error}") from None
    # pynvml keeps the library it loaded in a module global: when a real
    # libnvidia-ml was loaded before (driver not loaded), replace it.
    current = pynvml.nvmlLib
    if current is not None and getattr(current, "_handle", None) != lib._handle:
        pynvml.nvmlLib = lib
        pynvml._nvmlGetFunctionPointer_cache.clear()


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _nvml_error(action: str, error: pynvml.NVMLError) -> GpuError:
    return GpuError(f"NVML: {action} failed: {error}")


def _init(simulate: bool) -> None:
    if simulate:
        load_simgpu()
    try:
        pynvml.nvmlInit()
        return
    except pynvml.NVMLError as error:
        if simulate or error.value not in _NO_DRIVER:
            raise _nvml_error("init", error) from None
        reason = str(error)
    print(f"cgpu_km: no NVIDIA driver ({reason}); using the simulated GPU (simgpu)",
          file=sys.stderr)
    load_simgpu()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        raise _nvml_error("init of simgpu", error) from None


def _read_gpu(position: int) -> GpuInfo:
    action = f"reading GPU {position}"
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(position)
        index = int(pynvml.nvmlDeviceGetIndex(handle))
        uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        name = _text(pynvml.nvmlDeviceGetName(handle))
        total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except pynvml.NVMLError as error:
        raise _nvml_error(action, error) from None
    return GpuInfo(index=index, uuid=uuid, name=name, memory_total=total)


def discover_gpus(simulate: bool | None = None) -> list[GpuInfo]:
    """The host's GPUs in NVML index order; GpuError on failure.

    `simulate=None` follows $CGPU_SIMULATE.
    """
    _init(simulate_requested() if simulate is None else simulate)
    try:
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as error:
            raise _nvml_error("counting GPUs", error) from None
        return [_read_gpu(position) for position in range(count)]
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
