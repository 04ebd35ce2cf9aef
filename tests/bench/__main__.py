"""`make bench`: compute shares counted in the workloads, and what the system costs.

Every container is a `cgpu-run` job running `simgpu/sharework`, which
counts the kernels it completes; a share is what the containers completed,
compared with a fixed target, never a figure from NVML or the daemon. Run on
simgpu with the real daemon and the FUSE tree, under the default engine and
again under SIMGPU_SCHED=fifo:

- shares: two containers at weights 1:2 under policy 2, started together,
  for 50 us to 20 ms kernels and 1, 4 and 8 processes per container; 8 s
  runs, longer where the steady part would hold too few of the smaller
  container's kernels to resolve its target (`resolving_seconds`);
- switch: both containers' total throughput against one container alone;
- caps: a lone container under policy 0 (max_inst 4) and policy 3 (weight
  3 of 8), against its solo throughput;
- p1: policy 1, two containers 1:1;
- latency: an interactive container's request latency beside busy
  neighbours, under no scheduler and policies 1, 2 and 4 (`latency`);
- loaded: shares and latency again beside 2 and 4 CPU-bound processes per
  core, the latency against no scheduler under the same load (`loaded`).

Then the daemon's CPU use with 25 containers on each of 8 GPUs, beside the
host's own cost of the same wake-ups (cpu), what
libcgpu adds to launches and allocations (libcgpu), and the data plane's
deadlines, which tests only assert happen: fail open, the in-flight queue, the
drain after a close (deadlines); and the daemon's stops, from its detection to
the process gone, by route, 8 at once (stops: runc containers, as root); and
what a process that launches past libcgpu's gate gets of the GPU, the daemon's
compute check on (attacks: runc containers, as root). Every part runs with the
compute check on, and says how many processes it stopped (target: none but
the attackers').
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cgpu_km.daemon.snapshot import read_snapshot
from tests.bench import attacks, deadlines, latency, libcgpu_bench, loaded, stops
from tests.bench.shares import (
    STEADY_AFTER,
    Report,
    Summary,
    Workload,
    count,
    measure,
    resolving_seconds,
    started,
    summarize,
)
from tests.daemon.simbox import SimHost, fuse_tree, missing

KERNELS_US = (50, 1000, 5000, 20000)
PROCS = (1, 4, 8)
PERIOD = 0.02
ENGINES: tuple[tuple[str, str | None], ...] = (
    ("default engine (SIMGPU_SCHED unset)", None),
    ("SIMGPU_SCHED=fifo", "fifo"),
)
PARTS = ("shares", "switch", "caps", "p1", "latency", "loaded", "cpu", "libcgpu", "deadlines",
         "stops", "attacks")
# Targets: |error| of the 1:2 ratio, and what switching and caps must keep.
WHOLE_TARGET, STEADY_TARGET, WINDOW_TARGET = 0.05, 0.02, 0.08
# ... and of ctr1's share in any 1 s window, in points, where kernels are 1 ms or shorter.
WINDOW_POINTS_TARGET, WINDOW_POINTS_KERNELS_US = 5.0, 1000
SWITCH_TARGET = 0.95
CAP_TARGET = 0.02


def work(name: str, us: int, procs: int = 1, *, weight: int) -> Workload:
    """A container whose processes each keep max(2, 1 ms of kernels) launches outstanding:
    with 2 of 50 us, a process waking late on a small host leaves its own stream idle."""
    return Workload(name, us, procs, weight=weight, depth=max(2, math.ceil(1000 / us)))


def label(us: int) -> str:
    return f"{us / 1000:g} ms" if us >= 1000 else f"{us} us"


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def steady_rate(report: Report, seconds: float) -> float:
    """Kernels per second from STEADY_AFTER to the end."""
    return count(report, report.t0 + STEADY_AFTER, report.t0 + seconds) / (seconds - STEADY_AFTER)


@dataclass
class Engine:
    """One engine's runs on one simulated host; solo rates are measured once per size."""

    host: SimHost
    seconds: float
    resolve: bool = True  # lengthen pairs whose steady part cannot resolve STEADY_TARGET
    solo: dict[int, float] = field(default_factory=dict)
    runs: int = 0

    def run(self, policy: int, workloads: Sequence[Workload], max_inst: int = 16,
            seconds: float | None = None) -> dict[str, Report]:
        self.host.echo("0/max_inst", max_inst)
        self.host.echo("0/policy", policy)
        self.runs += 1
        return measure(self.host, workloads, self.seconds if seconds is None else seconds,
                       suffix=f"-{self.runs}")

    def lateness(self) -> tuple[int, float, float]:
        """GPU 0's dispatcher so far: wake-ups at a deadline, seconds late in all, most."""
        snapshot = read_snapshot(self.host.state_dir / "snapshot.json")
        gpu = next((g for g in snapshot.gpus if g.index == 0), None) if snapshot else None
        if gpu is None:
            return (0, 0.0, 0.0)
        return gpu.dispatch_late_wakes, gpu.dispatch_late_seconds, gpu.dispatch_late_max_seconds

    def solo_rate(self, us: int) -> float:
        if us not in self.solo:
            got = self.run(2, [work("solo", us, weight=1)])
            self.solo[us] = steady_rate(got["solo"], self.seconds)
        return self.solo[us]

    def pair(self, policy: int, us: int, procs: int, weights: tuple[int, int],
             target: float) -> Summary:
        seconds = self.seconds
        if self.resolve:
            smaller = min(weights) / sum(weights)
            seconds = resolving_seconds(us, procs, smaller, STEADY_TARGET, self.seconds)
        got = self.run(policy, [work("c1", us, procs, weight=weights[0]),
                                work("c2", us, procs, weight=weights[1])], seconds=seconds)
        return summarize(got["c1"], got["c2"], seconds, target)


def print_stops(host: SimHost, what: str) -> None:
    """How many processes the daemon stopped (or would have) while `what` ran: the
    compute check, the bypass check, the backstop (target: none)."""
    log = host.daemon_log()
    judged = log.count("of GPU time in the last")
    stopped = log.count(": stopping it") + log.count(": reported only")
    audited = log.count(": audited for ")
    print(f"{what}: the daemon judged {judged} processes for GPU time, stopped {stopped} "
          f"in all (target: 0) {verdict(judged == 0 and stopped == 0)}; audited {audited} "
          f"honest containers (quiet spans; target: 0) {verdict(audited == 0)}\n")


def print_head(columns: str) -> None:
    print(columns)
    print("-" * len(columns))


def share_table(engine: Engine, procs_list: Sequence[int]) -> dict[int, float]:
    """The 1:2 table; returns each kernel size's steady total rate with 1 process."""
    longer = (f" or longer (s: where one kernel per process at each end of the steady part "
              f"is more than {100 * STEADY_TARGET:g}% of ctr1's kernels in it)"
              if engine.resolve else "")
    print(f"Shares: policy 2, weights 1:2 (target ratio 2), started together, "
          f"{engine.seconds:g} s{longer}; steady from {STEADY_AFTER:g} s; 1 s windows every "
          f"0.1 s")
    print_head(f"{'kernel':>8} {'procs':>5} {'s':>3} | {'ctr1 k/s':>9} {'ctr2 k/s':>9} | "
               f"{'whole':>6} {'error':>7} | {'steady':>6} {'error':>7} | {'worst 1 s window':>16} "
               f"{'ctr1 pp':>7}")
    worst = [0.0, 0.0, 0.0]
    worst_points = 0.0
    totals: dict[int, float] = {}
    for us in KERNELS_US:
        for procs in procs_list:
            s = engine.pair(2, us, procs, (1, 2), 2.0)
            errors = (s.whole_error, s.steady_error, s.worst_window_error)
            worst = [max(w, abs(e)) for w, e in zip(worst, errors, strict=True)]
            if us <= WINDOW_POINTS_KERNELS_US:
                worst_points = max(worst_points, abs(s.worst_window_points))
            r1, r2 = s.rates()
            if procs == 1:
                totals[us] = sum(s.steady) / (s.seconds - STEADY_AFTER)
            print(f"{label(us):>8} {procs:>5} {s.seconds:>3.0f} | {r1:>9.0f} {r2:>9.0f} | "
                  f"{s.whole[1] / max(s.whole[0], 1):>6.3f} {100 * s.whole_error:>+6.2f}% | "
                  f"{s.steady[1] / max(s.steady[0], 1):>6.3f} {100 * s.steady_error:>+6.2f}% | "
                  f"{100 * s.worst_window_error:>+15.2f}% {s.worst_window_points:>+7.2f}",
                  flush=True)
    for name, value, target in zip(("whole run", "steady", "1 s window"), worst,
                                   (WHOLE_TARGET, STEADY_TARGET, WINDOW_TARGET), strict=True):
        print(f"worst {name} error: {100 * value:.2f}% (target: within {100 * target:g}%) "
              f"{verdict(value <= target)}")
    print(f"worst 1 s window, {label(WINDOW_POINTS_KERNELS_US)} kernels and shorter: ctr1's "
          f"share {worst_points:.2f} points off (target: within {WINDOW_POINTS_TARGET:g}) "
          f"{verdict(worst_points <= WINDOW_POINTS_TARGET)}")
    print()
    return totals


def switching(engine: Engine, together: Mapping[int, float]) -> None:
    print("Switching: both containers together (1:2, 1 process each) against one alone, "
          "steady kernels/s")
    print_head(f"{'kernel':>8} | {'alone':>9} {'together':>9} | {'kept':>7}  target >= "
               f"{100 * SWITCH_TARGET:g}%")
    for us in KERNELS_US:
        both = together.get(us)
        if both is None:
            pair = engine.pair(2, us, 1, (1, 2), 2.0)
            both = sum(pair.steady) / (pair.seconds - STEADY_AFTER)
        alone = engine.solo_rate(us)
        kept = both / alone
        print(f"{label(us):>8} | {alone:>9.0f} {both:>9.0f} | {100 * kept:>6.1f}%  "
              f"{verdict(kept >= SWITCH_TARGET)}", flush=True)
    print()


def caps(engine: Engine) -> None:
    print("Caps: a lone container's steady throughput against its solo throughput "
          f"(target within {100 * CAP_TARGET:g} points)")
    print_head(f"{'kernel':>8} | {'case':<24} | {'share':>6} {'target':>6} {'error':>7}")
    for us in KERNELS_US:
        alone = engine.solo_rate(us)
        for policy, weight, max_inst in ((0, 1, 4), (3, 3, 8)):
            got = engine.run(policy, [work("capped", us, weight=weight)], max_inst)
            share = steady_rate(got["capped"], engine.seconds) / alone
            target = weight / max_inst
            case = (f"policy 0, max_inst {max_inst}" if policy == 0
                    else f"policy 3, weight {weight} of {max_inst}")
            print(f"{label(us):>8} | {case:<24} | {share:>6.3f} {target:>6.3f} "
                  f"{100 * (share - target):>+5.1f}pp {verdict(abs(share - target) <= CAP_TARGET)}",
                  flush=True)
    print()


def policy_one(engine: Engine) -> None:
    print("Policy 1: two containers, 1 process each (target ratio 1)")
    print_head(f"{'kernel':>8} | {'ctr1 k/s':>9} {'ctr2 k/s':>9} | {'steady':>6} {'error':>7} | "
               f"{'worst 1 s window':>16}")
    for us in KERNELS_US:
        s = engine.pair(1, us, 1, (1, 1), 1.0)
        r1, r2 = s.rates()
        print(f"{label(us):>8} | {r1:>9.0f} {r2:>9.0f} | "
              f"{s.steady[1] / max(s.steady[0], 1):>6.3f} {100 * s.steady_error:>+6.2f}% | "
              f"{100 * s.worst_window_error:>+15.2f}%", flush=True)
    print()


def latency_table(base: Path, root: Path, quick: bool, slice_s: float | None) -> None:
    """Every row of `latency.ROWS` under each scheduler of `latency.COLUMNS`, default engine."""
    seconds = 2.0 if quick else 3.0
    host = SimHost(base / "latency", root, gpus=8, env={"SIMGPU_SCHED": None})
    engine = Engine(host, seconds=seconds)
    slice_note = "default slice" if slice_s is None else f"slice {slice_s * 1000:g} ms"
    print(f"Latency: {latency.ABOUT}; {seconds:g} s per case, default engine, daemon period "
          f"{PERIOD * 1000:g} ms, {slice_note}. none = policy 5 (every gate open: simgpu's "
          f"time slicing); {latency.LEGEND}")
    print_head(latency.HEAD)
    worst = 0.0
    try:
        host.start_daemon(PERIOD, *(() if slice_s is None else ("--slice", str(slice_s))))
        for row in latency.ROWS:
            got = {column: latency.result(row, engine.run(policy, row.workloads()), seconds)
                   for column, policy in latency.COLUMNS}
            none = got["none"]
            for column, _policy in latency.COLUMNS:
                print(latency.line(row, column, got[column], none), flush=True)
                if column != "none":
                    worst = max(worst, latency.ratio(got[column].p99, none.p99))
        print_stops(host, "latency")
    finally:
        host.close()
    print(f"worst p99 against none under policies 1, 2, 4: {worst:.2f}x (target: at most "
          f"{latency.P99_TARGET:g}x) {verdict(worst <= latency.P99_TARGET)}\n")


def loaded_host(base: Path, root: Path, quick: bool, slice_s: float | None) -> None:
    """`loaded`'s shares and latency rows on one simulated host, default engine."""
    host = SimHost(base / "loaded", root, gpus=8, env={"SIMGPU_SCHED": None})
    slice_note = "default slice" if slice_s is None else f"slice {slice_s * 1000:g} ms"
    print(f"=== loaded host: default engine, daemon period {PERIOD * 1000:g} ms, "
          f"{slice_note} ===\n")
    try:
        host.start_daemon(PERIOD, *(() if slice_s is None else ("--slice", str(slice_s))))
        loads = loaded.QUICK_LOADS if quick else loaded.LOADS
        loaded.share_rows(Engine(host, seconds=3.0 if quick else 8.0, resolve=False),
                          loaded.QUICK_KERNELS_US if quick else loaded.KERNELS_US, loads)
        loaded.latency_rows(Engine(host, seconds=2.0 if quick else 3.0),
                            loaded.QUICK_LATENCY_ROWS if quick else loaded.LATENCY_ROWS, loads)
        print_stops(host, "loaded host")
    finally:
        host.close()


def engine_parts(base: Path, root: Path, parts: Sequence[str], quick: bool,
                 slice_s: float | None) -> None:
    procs_list = (1, 8) if quick else PROCS
    for name, sched in ENGINES:
        print(f"=== {name} ===\n")
        host = SimHost(base / f"engine-{sched or 'default'}", root, gpus=8,
                       env={"SIMGPU_SCHED": sched})
        engine = Engine(host, seconds=3.0 if quick else 8.0, resolve=not quick)
        try:
            host.start_daemon(PERIOD, *(() if slice_s is None else ("--slice", str(slice_s))))
            slice_note = "default slice" if slice_s is None else f"slice {slice_s * 1000:g} ms"
            print(f"(daemon period {PERIOD * 1000:g} ms, {slice_note}; each container a "
                  f"cgpu-run job of sharework processes, each keeping max(2, 1 ms of "
                  f"kernels) launches outstanding)\n")
            totals = share_table(engine, procs_list) if "shares" in parts else {}
            if "switch" in parts:
                switching(engine, totals)
            if "caps" in parts:
                caps(engine)
            if "p1" in parts:
                policy_one(engine)
            print_stops(host, name)
        finally:
            host.close()


def daemon_cpu(base: Path, root: Path, quick: bool, profile: Path | None = None) -> None:
    gpus, per_gpu = 8, 25
    seconds = 10.0 if quick else 30.0
    print(f"Daemon CPU: {per_gpu} containers (cgpu-run jobs) on each of {gpus} simulated GPUs, "
          f"policy 4, 5 ms kernels; % of one core (target: under 2% at the default period)")
    host = SimHost(base / "cpu", root, gpus=gpus)

    def dispatched() -> tuple[int, int]:
        """The dispatchers' wake-ups and switches so far, all GPUs (the snapshot's)."""
        snapshot = read_snapshot(host.state_dir / "snapshot.json")
        gpus = snapshot.gpus if snapshot is not None else ()
        return sum(g.dispatch_wakes for g in gpus), sum(g.switches for g in gpus)

    def cpu_of_daemon(period: float, what: str, profiled: bool = False) -> float:
        """Print the row; the dispatchers' wake-ups a second, all GPUs."""
        host.start_daemon(period)
        time.sleep(8)  # past the start: reading 200 containers, feeding their meminfo
        cpu0, wall0, (wakes0, switches0) = host.daemon_cpu_seconds(), time.monotonic(), dispatched()
        if profiled and profile is not None:
            record_profile(host, profile, seconds)
        else:
            time.sleep(seconds)
        cpu = host.daemon_cpu_seconds() - cpu0
        wall = time.monotonic() - wall0
        wakes, switches = (now - then for now, then in zip(dispatched(), (wakes0, switches0),
                                                              strict=True))
        per_switch = (f"; {switches / wall:4.0f} switches/s, {wakes / switches:4.1f} wake-ups "
                      f"and {1e3 * cpu / switches:5.2f} ms CPU per switch" if switches else "")
        print(f"  {what:<40} period {period * 1000:3.0f} ms: {100 * cpu / wall:5.1f}%"
              f"{per_switch}", flush=True)
        host.kill_daemon(15)
        return wakes / wall

    def name(gpu: int, k: int) -> str:
        return f"g{gpu}c{k:02d}"

    try:
        for gpu in range(gpus):
            host.echo(f"{gpu}/max_inst", per_gpu)
            host.echo(f"{gpu}/policy", 4)
            for k in range(1, per_gpu):
                host.cgpu_run(name(gpu, k), ["sleep", "86400"], gpu=gpu, weight=0)
        for gpu in range(gpus):
            for k in range(1, per_gpu):
                host.wait_registered(name(gpu, k), gpu)
        cpu_of_daemon(0.1, "idle (24 registered, none busy)")
        busy = [Workload(name(gpu, 0), 5000, gpu=gpu, weight=1) for gpu in range(gpus)]
        periods = (0.1,) if quick else (0.1, 0.05, 0.02)
        with started(host, busy, (8 + seconds + 2) * (len(periods) + 1), delay=0.1):
            for period in periods:
                cpu_of_daemon(period, "one busy per GPU")
            # Where unused time stays idle, a lone holder with less than the whole
            # GPU is watched for going idle: the same layout under policy 2, where
            # the busy one has the whole GPU (its neighbours have weight 0), then
            # half of it (one idle neighbour of weight 1).
            for gpu in range(gpus):
                host.echo(f"{gpu}/policy", 2)
            cpu_of_daemon(0.1, "one busy per GPU, policy 2")
            for gpu in range(gpus):
                host.echo(f"{gpu}/{name(gpu, 1)}/weight", 1)
            cpu_of_daemon(0.1, "  the same, its share 1/2")
            for gpu in range(gpus):
                host.echo(f"{gpu}/{name(gpu, 1)}/weight", 0)
                host.echo(f"{gpu}/policy", 4)
        for gpu in range(gpus):  # a second busy container in place of an idle one
            host.stop(name(gpu, 1))
            host.wait_unregistered(name(gpu, 1), gpu)
        pairs = [Workload(name(gpu, k), 5000, gpu=gpu, weight=1)
                 for gpu in range(gpus) for k in (0, 1)]
        with started(host, pairs, 8 + seconds + 2, delay=0.1):
            wakes = cpu_of_daemon(0.1, "two busy per GPU (every GPU switching)", profiled=True)
        print_wake_floor(base, per_gpu, gpus / wakes if wakes else 0.1, wakes)
        print_stops(host, "daemon CPU")
    finally:
        host.close()
    print()


def print_wake_floor(base: Path, words: int, asleep: float, wakes: float) -> None:
    """What the same wake-ups cost a thread that does nothing else: tests/bench/
    wakefloor.c sleeping in futex_waitv on `words` shared words for `asleep`
    seconds at a time, measured now, beside the row above (the floor under
    any dispatcher of this host that wakes as often, in C too): woken by
    another process's ring (as a drain's answer wakes a dispatcher), and at
    its own deadline (a timer that expires, as at a slice's end)."""
    program = base / "wakefloor"
    subprocess.run(["gcc", "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-o",
                    str(program), str(Path(__file__).with_name("wakefloor.c"))], check=True)
    sleep_us = max(1, round(asleep * 1e6))
    rounds = max(50, min(2000, round(3 / asleep)))
    for how, mode in (("rung by another process", ["ring"]), ("at its deadline", [])):
        per_wake = float(subprocess.run([str(program), str(words), str(sleep_us), str(rounds),
                                         *mode], check=True, capture_output=True,
                                        text=True).stdout)
        print(f"  the host's floor: a C thread asleep in futex_waitv on {words} shared words, "
              f"{sleep_us / 1000:.1f} ms at a time, {how}: {per_wake:.1f} us of CPU a "
              f"wake-up; at the row's {wakes:.0f} wake-ups a second, "
              f"{100 * per_wake * wakes / 1e6:.1f}% of a core", flush=True)


def record_profile(host: SimHost, out: Path, seconds: float) -> None:
    """Sample the daemon with py-spy (the bench extra) for `seconds`, every thread,
    into `out` as collapsed stacks (one line a stack, its sample count last)."""
    assert host.daemon is not None
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        print("  (no profile: py-spy is not installed; pip install -e '.[bench]')")
        time.sleep(seconds)
        return
    subprocess.run([spy, "record", "--pid", str(host.daemon.pid), "--duration",
                    str(int(seconds)), "--rate", "250", "--format", "raw", "--output",
                    str(out), "--nonblocking"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"  profile: {out} (py-spy, collapsed stacks)")


def parse_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"parts are {', '.join(PARTS)}; got {text!r}")
    return parts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="3 s runs, 1 and 8 processes, one daemon period (a rough run)")
    parser.add_argument("--only", type=parse_parts, default=list(PARTS),
                        help=f"comma list of parts: {','.join(PARTS)}")
    parser.add_argument("--profile", type=Path, default=None, metavar="FILE",
                        help="cpu part: py-spy's collapsed stacks of the daemon while "
                             "every GPU switches, into FILE")
    parser.add_argument("--slice", type=float, default=None, metavar="SECONDS",
                        help="the daemon's --slice for the engine parts (default: its own)")
    args = parser.parse_args(argv)
    parts: list[str] = args.only
    why = missing()
    if why is None and shutil.which("fusermount") is None:
        why = "fusermount is not installed"
    if why is None and os.geteuid() != 0:
        why = "FUSE mounts with allow_other need root"
    started_at = time.monotonic()
    simulated: list[Callable[[Path, Path], None]] = []
    if any(p in parts for p in ("shares", "switch", "caps", "p1")):
        simulated.append(lambda base, root: engine_parts(base, root, parts, args.quick,
                                                             args.slice))
    if "latency" in parts:
        simulated.append(lambda base, root: latency_table(base, root, args.quick, args.slice))
    if "loaded" in parts:
        simulated.append(lambda base, root: loaded_host(base, root, args.quick, args.slice))
    if "cpu" in parts:
        simulated.append(lambda base, root: daemon_cpu(base, root, args.quick, args.profile))
    if simulated and why is not None:
        print(f"simulated-host parts skipped: {why}\n")
    elif simulated:
        base = Path(tempfile.mkdtemp(prefix="cgpu-bench-"))
        try:
            with fuse_tree(base, gpus=8) as root:
                for part in simulated:
                    part(base, root)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    if "libcgpu" in parts:
        libcgpu_bench.main(["--rounds", "3"] if args.quick else [])
    if "deadlines" in parts:
        deadlines.main(["--rounds", "1"] if args.quick else [])
    if "stops" in parts:
        stops.main([])
    if "attacks" in parts:
        attacks.main([])
    print(f"bench took {time.monotonic() - started_at:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
