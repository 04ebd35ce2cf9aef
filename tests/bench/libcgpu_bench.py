"""What libcgpu adds to launches and allocations, measured side by side in one run.

    python -m tests.bench.libcgpu_bench [--rounds N]

Each case runs the same driver-API loop (tests/libcgpu/bench.c) without the
library and with it (a region, gate open), alternating, N rounds; the table
shows medians. Two drivers: the null driver (every call returns at once, so
the difference is libcgpu's own cost) and simgpu (a realistic driver path).
Targets: under 50 ns added per launch on the null driver, under 1% throughput
loss for 50 us kernels.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cgpu_km.dataplane import region as region_mod

REPO = Path(__file__).resolve().parents[2]
SIMGPU = REPO / "simgpu"
LIBCGPU = REPO / "libcgpu"
SOURCES = REPO / "tests" / "libcgpu"
CFLAGS = ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{LIBCGPU / 'include'}"]


@dataclass(frozen=True)
class Case:
    name: str
    driver: str  # "null" or "simgpu"
    args: tuple[str, ...]
    column: int  # which number of bench's output line
    kind: str  # "added" (ns) or "loss" (throughput)
    target: str
    seen: int = 0  # other processes the daemon published in the region (each allocation sums them)


CASES = (
    Case("launch, zero-length kernel", "null", ("launch", "500000", "sleep_0"), 0, "added",
         "< 50 ns"),
    Case("launch, zero-length kernel", "simgpu", ("launch", "20000", "sleep_0"), 0, "added",
         "-"),
    Case("throughput, 50 us kernels", "simgpu", ("launch", "2000", "sleep_50"), 1, "loss",
         "< 1 %"),
    Case("cuMemAlloc + cuMemFree", "null", ("alloc", "200000", "4096"), 0, "added", "-"),
    Case(f"... {region_mod.MAX_SEEN} processes seen", "null", ("alloc", "200000", "4096"), 0,
         "added", "-", seen=region_mod.MAX_SEEN),
    Case("cuMemAlloc + cuMemFree", "simgpu", ("alloc", "20000", str(1 << 20)), 0, "added",
         "-"),
)


def build(tmp: Path) -> dict[str, Path]:
    """Libraries and the bench loop for both drivers; returns the paths."""
    for directory in (SIMGPU, LIBCGPU):
        subprocess.run(["make", "-s", "-C", str(directory)], check=True)
    null_dir = tmp / "null"
    null_dir.mkdir()
    null_lib = null_dir / "libcuda.so.1"
    subprocess.run(["gcc", *CFLAGS, "-fPIC", "-shared", "-fvisibility=hidden",
                    "-Wl,-soname,libcuda.so.1", "-o", str(null_lib),
                    str(SOURCES / "nulldriver.c")], check=True)
    bench = tmp / "bench"
    subprocess.run(["gcc", *CFLAGS, "-o", str(bench), str(SOURCES / "bench.c"),
                    str(null_lib)], check=True)
    return {"bench": bench, "null": null_dir, "simgpu": SIMGPU}


def publish_seen(region: region_mod.Region, count: int) -> None:
    """`count` other processes of the container, 1 byte each, as the daemon publishes them."""
    pidns = os.stat("/proc/self/ns/pid").st_ino
    region.publish_seen([region_mod.Seen(0, pidns, 1 + i, 0, 1) for i in range(count)])


def measure(paths: dict[str, Path], tmp: Path, region: region_mod.Region, case: Case,
            with_library: bool) -> float:
    publish_seen(region, case.seen)
    env = {
        "PATH": "/usr/bin:/bin",
        "LD_LIBRARY_PATH": str(paths[case.driver]),
        "SIMGPU_STATE": str(tmp / "simgpu-state"),
        "SIMGPU_DEVICES": "Tesla T4:15109MiB",
        "SIMGPU_CONTEXT_MEM": "0",
    }
    if with_library:
        env["LD_PRELOAD"] = str(LIBCGPU / "libcgpu.so")
        env["CGPU_REGION"] = str(tmp / "bench.region")
    out = subprocess.run([str(paths["bench"]), *case.args], env=env, check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[case.column])


def median_pair(run: Callable[[bool], float], rounds: int) -> tuple[float, float]:
    """Medians of both; which one runs first alternates, so order effects cancel."""
    without: list[float] = []
    with_: list[float] = []
    for round_ in range(rounds):
        for with_library in ((False, True) if round_ % 2 == 0 else (True, False)):
            (with_ if with_library else without).append(run(with_library))
    return statistics.median(without), statistics.median(with_)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cgpu-bench-") as name:
        tmp = Path(name)
        paths = build(tmp)
        # Gates open from the start: a region created closed fails open once its
        # creation heartbeat is 2 s old, and then every launch takes the gate's
        # slow path (it looks at the clock), which is not what is measured here.
        region = region_mod.Region.create(tmp / "bench.region", "bench",
                                          [region_mod.GpuSpec(limit=8 << 30)], gates_open=True)
        print("libcgpu: cost with the library (region present, gate open) against without,")
        print(f"median of {args.rounds} alternating rounds; ns per operation")
        header = f"{'case':<30} {'driver':<7} {'without':>10} {'with':>10} {'added':>10} " \
                 f"{'ratio':>7}  {'target':<9}"
        print(header)
        print("-" * len(header))
        for case in CASES:
            base, lib = median_pair(functools.partial(measure, paths, tmp, region, case),
                                    args.rounds)
            if case.kind == "loss":
                loss = (1 - base / lib) * 100  # throughput = 1 / time per kernel
                added = f"{loss:+.2f} %"
            else:
                added = f"{lib - base:+.1f}"
            print(f"{case.name:<30} {case.driver:<7} {base:>10.1f} {lib:>10.1f} {added:>10} "
                  f"{lib / base:>7.3f}  {case.target:<9}")
        print("null: libcgpu's own cost; simgpu: its driver path (fcntl locks, mmap) varies by")
        print("microseconds between runs, so small differences there are noise.")
        region.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
