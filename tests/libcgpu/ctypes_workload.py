"""A Python workload on libcuda.so.1 through ctypes (the dlsym path of libcgpu).

    python ctypes_workload.py OP ...
    OP: alloc N | free | info | total | launch COUNT NAME | wait (read a line from stdin)
        | exec (run this script again, same pid, with the OPs that follow)

Prints one line "OP ... rc=<CUresult>" per operation, like workload.c.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path


def kernels_ptx() -> bytes:
    """The PTX module of kernels.h (shared with the C workloads)."""
    text = (Path(__file__).resolve().parent / "kernels.h").read_text()
    body = text[text.index("kernels_ptx[] ="):].split(";\n", 1)[0]
    return "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', body)).replace("\\n", "\n").encode()


PTX = kernels_ptx()


def main(ops: list[str]) -> int:
    cuda = ctypes.CDLL("libcuda.so.1")
    device = ctypes.c_int()
    ctx = ctypes.c_void_p()
    steps: tuple[Callable[[], int], ...] = (
        lambda: cuda.cuInit(0), lambda: cuda.cuDeviceGet(ctypes.byref(device), 0),
        lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device),
        lambda: cuda.cuCtxSetCurrent(ctx))
    for call in steps:
        rc = call()
        if rc != 0:
            print(f"init rc={rc}")
            return 1
    held: list[int] = []
    module = ctypes.c_void_p()
    i = 0
    while i < len(ops):
        op = ops[i]
        if op == "alloc":
            size = int(ops[i + 1])
            i += 1
            ptr = ctypes.c_uint64()
            rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))
            if rc == 0:
                held.append(ptr.value)
            print(f"alloc {size} rc={rc}")
        elif op == "free":
            rc = cuda.cuMemFree_v2(ctypes.c_uint64(held.pop())) if held else 1
            print(f"free rc={rc}")
        elif op == "info":
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            rc = cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
            print(f"info free={free.value} total={total.value} rc={rc}")
        elif op == "total":
            total = ctypes.c_size_t()
            rc = cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device)
            print(f"total {total.value} rc={rc}")
        elif op == "launch":
            count, name = int(ops[i + 1]), ops[i + 2].encode()
            i += 2
            func = ctypes.c_void_p()
            rc = 0
            if not module.value:
                rc = cuda.cuModuleLoadData(ctypes.byref(module), PTX)
            if rc == 0:
                rc = cuda.cuModuleGetFunction(ctypes.byref(func), module, name)
            for _ in range(count):
                if rc:
                    break
                rc = cuda.cuLaunchKernel(func, 1, 1, 1, 1, 1, 1, 0, None, None, None)
            if rc == 0:
                rc = cuda.cuCtxSynchronize()
            print(f"launch {count} rc={rc}")
        elif op == "wait":
            print("waiting", flush=True)
            sys.stdin.readline()
        elif op == "exec":
            print("exec", flush=True)
            os.execv(sys.executable, [sys.executable, __file__, *ops[i + 1:]])
        else:
            print(f"unknown op {op}", file=sys.stderr)
            return 2
        i += 1
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
