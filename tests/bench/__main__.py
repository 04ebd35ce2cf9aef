"""`make bench`: compute shares and daemon cost, measured side by side in one run.

1. The ResNet-shaped table of the cGPU documents: two containers at weights
   1:2 under policy 2, for kernel durations from 50 us to 20 ms and 1 to 8
   processes per container. Measured on simgpu with the real daemon, the
   FUSE tree, regions and libcgpu (throughput = kernels per second of each
   container, from an independent NVML meter); next to each row, the same
   case on the pure engine model (`cgpu_km.sched_sim`, simulated time).
2. The daemon's CPU use with 25 containers on each of 8 simulated GPUs.

Without simgpu/libcgpu built, or without FUSE, only the engine-model
columns are printed, labelled as such. `--quick` shortens every window.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cgpu_km import region as region_mod
from cgpu_km.sched import ContainerSpec, GateScheduler, GpuConfig, Policy
from cgpu_km.sched_sim import EngineSim, SimProcess, run
from tests.bench import libcgpu_bench
from tests.daemon.simbox import VENV_BIN, SimNode, missing

KERNELS_US = (50, 1000, 5000, 20000)
PROCS = (1, 4, 8)
WEIGHTS = (1, 2)
# simgpu keeps its default launch queue (1024); libcgpu bounds each process's
# queue to the region's max_inflight, and to about 4 ms of queued work as it
# measures it (what the stream drains per launch, other processes' kernels
# included): the engine model's queue depth follows the same rule.
QUEUE_DEPTH = region_mod.DEFAULT_MAX_INFLIGHT
DRAIN_S = 0.004


def model_depth(us: int, procs: int) -> int:
    """libcgpu's bound for `us` kernels with `procs` processes per container, both busy."""
    per_launch = us / 1e6 * 2 * procs
    return max(2, min(QUEUE_DEPTH, int(DRAIN_S / per_launch)))
PERIOD = 0.02


def window_for(us: int, quick: bool) -> float:
    seconds = 8.0 if us <= 1000 else 12.0 if us <= 5000 else 24.0
    return seconds / 3 if quick else seconds


def model_ratio(us: int, procs: int, seconds: float) -> float:
    config = GpuConfig(policy=Policy.WEIGHTED, containers={
        "c1": ContainerSpec(WEIGHTS[0]), "c2": ContainerSpec(WEIGHTS[1])})
    engine = EngineSim([SimProcess(name, us / 1e6, model_depth(us, procs))
                        for name in ("c1", "c2") for _ in range(procs)])
    scheduler = GateScheduler(config, period=PERIOD)
    start: dict[str, float] = {}

    def mark(t: float, usage: dict[str, float]) -> None:
        if not start and t >= 2.0:
            start.update(usage)

    usage = run(scheduler, engine, seconds + 2.0, lambda t: {"c1", "c2"}, on_step=mark)
    return (usage["c2"] - start["c2"]) / (usage["c1"] - start["c1"])


class Tree:
    """A FUSE control tree for the whole run."""

    def __init__(self, base: Path, gpus: int) -> None:
        self.root = base / "tree"
        self.root.mkdir()
        self.log = (base / "fuse.log").open("wb")
        self.process = subprocess.Popen(
            [str(VENV_BIN / "cgpu-fuse"), "--root", str(self.root), "--gpus", str(gpus)],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not os.path.ismount(self.root):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("cgpu-fuse did not mount")
            time.sleep(0.05)

    def close(self) -> None:
        subprocess.run(["fusermount", "-u", "-z", str(self.root)], check=False)
        self.process.wait(timeout=10)
        self.log.close()


def share_table(base: Path, tree: Tree | None, quick: bool) -> None:
    print("Compute shares: policy 2 (weight-based), weights 1:2, target ratio 2.00")
    print(f"(simgpu queue 1024, libcgpu in-flight bound {QUEUE_DEPTH} launches per process and "
          f"about {DRAIN_S * 1000:.0f} ms, period {PERIOD * 1000:.0f} ms)")
    head = (f"{'kernel':>8} {'procs':>5} | {'ctr1 k/s':>9} {'ctr2 k/s':>9} {'ratio':>6} "
            f"{'target':>6} {'error':>7} | {'model ratio':>11} {'error':>7}")
    print(head)
    print("-" * len(head))
    worst = 0.0
    for us in KERNELS_US:
        for procs in PROCS:
            seconds = window_for(us, quick)
            target = WEIGHTS[1] / WEIGHTS[0]
            model = model_ratio(us, procs, seconds)
            model_cols = f"{model:>11.3f} {100 * (model / target - 1):>+6.2f}%"
            label = f"{us / 1000:g} ms" if us >= 1000 else f"{us} us"
            if tree is None:
                print(f"{label:>8} {procs:>5} | {'-':>9} {'-':>9} {'-':>6} {target:>6.2f} "
                      f"{'-':>7} | {model_cols}")
                continue
            node = SimNode(base / f"shares-{us}-{procs}", tree.root)
            try:
                (tree.root / "0" / "policy").write_text("2\n")
                node.add("c1", weight=WEIGHTS[0])
                node.add("c2", weight=WEIGHTS[1])
                node.start_daemon(PERIOD)
                node.start("c1", procs=procs, us=us)
                node.start("c2", procs=procs, us=us)
                time.sleep(2.0)
                got = node.measure(seconds)
            finally:
                node.close(unregister=True)
            ratio = got["c2"] / got["c1"] if got["c1"] > 0 else float("inf")
            error = 100 * (ratio / target - 1)
            worst = max(worst, abs(error))
            rate = 1e6 / us
            print(f"{label:>8} {procs:>5} | {got['c1'] * rate:>9.0f} {got['c2'] * rate:>9.0f} "
                  f"{ratio:>6.3f} {target:>6.2f} {error:>+6.2f}% | {model_cols}", flush=True)
    if tree is not None:
        print(f"worst simgpu ratio error: {worst:.2f}% (target: within 2%)")
    print()


def daemon_cpu(base: Path, tree: Tree, quick: bool) -> None:
    gpus, per_gpu = 8, 25
    seconds = 10.0 if quick else 30.0
    print(f"Daemon CPU: {per_gpu} containers on each of {gpus} simulated GPUs "
          f"({gpus * per_gpu} regions), one busy workload per GPU (5 ms kernels)")
    node = SimNode(base / "cpu", tree.root, gpus=gpus)
    try:
        for gpu in range(gpus):
            (tree.root / str(gpu) / "max_inst").write_text(f"{per_gpu}\n")
            (tree.root / str(gpu) / "policy").write_text("4\n")
            for k in range(per_gpu):
                node.add(f"g{gpu}c{k:02d}", gpu=gpu, weight=0 if k else 1)
        for gpu in range(gpus):
            node.start(f"g{gpu}c00", procs=1, us=5000)
        for period in (0.1, 0.05, 0.02):
            node.start_daemon(period)
            time.sleep(8)  # past the start: reading 200 containers, feeding their meminfo
            cpu0, wall0 = node.daemon_cpu_seconds(), time.monotonic()
            time.sleep(seconds)
            cpu = (node.daemon_cpu_seconds() - cpu0) / (time.monotonic() - wall0)
            print(f"  period {period * 1000:.0f} ms: daemon CPU {100 * cpu:.1f}% of one core "
                  f"(target: under 5%)", flush=True)
            node.kill_daemon(15)
    finally:
        node.close(unregister=True)
    print()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short windows (a rough run)")
    parser.add_argument("--only", choices=("shares", "cpu", "libcgpu"), help="run one part")
    args = parser.parse_args()
    why = missing()
    if why is None and shutil.which("fusermount") is None:
        why = "fusermount is not installed"
    if why is None and os.geteuid() != 0:
        why = "FUSE mounts with allow_other need root"
    base = Path(tempfile.mkdtemp(prefix="cgpu-bench-"))
    tree = None
    try:
        if why is not None:
            print(f"simgpu columns skipped: {why}; engine-model columns only\n")
        else:
            tree = Tree(base, gpus=8)
        started = time.monotonic()
        if args.only in (None, "shares"):
            share_table(base, tree, args.quick)
        if tree is not None and args.only in (None, "cpu"):
            daemon_cpu(base, tree, args.quick)
        if args.only in (None, "libcgpu"):
            libcgpu_bench.main(["--rounds", "3"] if args.quick else [])
        print(f"bench took {time.monotonic() - started:.0f} s")
    finally:
        if tree is not None:
            tree.close()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
