"""Synthetic stand-in for the ResNet50 worker, on the driver API through ctypes (simgpu).

    python3 synthetic_worker.py NAME SYNC_DIR

One step at batch B launches KERNELS kernels named `sleep_<us>` with
us = BASE_US + PER_IMAGE_US * B / KERNELS (simgpu runs a kernel that long),
then synchronizes the context: GPU time per image falls with the batch as
a network's does. Goes through `libcuda.so.1` with ctypes, so libcgpu sees
it on its dlsym path, as it sees Python programs on NVIDIA's driver.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))

if TYPE_CHECKING:  # mypy knows tests/gpu/phases.py by its package path
    from tests.gpu import phases
else:  # run as a script, next to phases.py
    import phases

KERNELS = 4
BASE_US = 2000
PER_IMAGE_US = 100


def kernel_us(batch: int) -> int:
    return (BASE_US + PER_IMAGE_US * batch) // KERNELS


class Driver:
    """The few driver calls a step needs; every failure raises with the CUresult."""

    def __init__(self) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.device = ctypes.c_int()
        self.context = ctypes.c_void_p()
        self.module = ctypes.c_void_p()
        self.check("cuInit", self.cuda.cuInit(0))
        self.check("cuDeviceGet", self.cuda.cuDeviceGet(ctypes.byref(self.device), 0))
        self.check("cuDevicePrimaryCtxRetain", self.cuda.cuDevicePrimaryCtxRetain(
            ctypes.byref(self.context), self.device))
        self.check("cuCtxSetCurrent", self.cuda.cuCtxSetCurrent(self.context))
        self.check("cuModuleLoadData", self.cuda.cuModuleLoadData(
            ctypes.byref(self.module), b"// simgpu times kernels by name\n"))

    @staticmethod
    def check(call: str, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"{call} failed: CUresult {rc}")

    def function(self, name: str) -> ctypes.c_void_p:
        func = ctypes.c_void_p()
        self.check("cuModuleGetFunction", self.cuda.cuModuleGetFunction(
            ctypes.byref(func), self.module, name.encode()))
        return func

    def launch(self, func: ctypes.c_void_p) -> None:
        self.check("cuLaunchKernel", self.cuda.cuLaunchKernel(
            func, 1, 1, 1, 1, 1, 1, 0, None, None, None))

    def synchronize(self) -> None:
        self.check("cuCtxSynchronize", self.cuda.cuCtxSynchronize())


def main(name: str, sync: Path) -> int:
    driver = Driver()

    def make_step(batch: int) -> Callable[[], None]:
        func = driver.function(f"sleep_{kernel_us(batch)}")

        def step() -> None:
            for _ in range(KERNELS):
                driver.launch(func)
            driver.synchronize()

        return step

    return phases.worker_main(name, sync, make_step)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
