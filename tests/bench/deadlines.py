"""The data plane's deadlines on simgpu: figures that no test asserts.

    python -m tests.bench.deadlines [--rounds N]

Tests assert that these things happen; how soon is printed here, measured on
libcgpu and simgpu with a region written as the daemon writes it:

- fail open: a launch held at a closed gate while a heartbeat thread stamps
  the region every 50 ms (a live daemon); the stamps stop (a daemon killed):
  from the last stamp to the launch's completion, for the default gate
  timeout and for a short one;
- said gone: the same launch, the heartbeat set to 0 (a daemon that stopped):
  from then to the launch's completion (libcgpu re-checks every 100 ms);
- in flight: 40 launches of 5 ms kernels without waiting, with the default
  `max_inflight` and without a bound: the launches still queued as the loop
  ended (counted by an event behind each) and the sync that drains them;
- drain: a flood of 5 ms kernels, its gate closed: from the close to the
  watcher's answer that what was queued has run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cgpu_km.dataplane import region as region_mod
from tests.libcgpu.sandbox import UUID, Built, Sandbox, build

KERNEL_US = 5000
SHORT_TIMEOUT_NS = 400_000_000


def held_launch(box: Sandbox) -> subprocess.Popen[str]:
    """A workload whose one launch waits at the closed gate of GPU 0 (the region's
    `pending` says so)."""
    region = box.region
    assert region is not None
    proc = box.popen([str(box.built.workload), "wait", "launch", "1", "sleep_0"])
    assert proc.stdout is not None
    assert proc.stdin is not None
    if proc.stdout.readline() != "waiting\n":
        raise RuntimeError(f"the workload did not start: {proc.communicate()}")
    region.set_gate(0, False)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    while region.activity(0).pending != 1:
        if proc.poll() is not None:
            raise RuntimeError(f"the launch went through a closed gate: {proc.communicate()}")
        time.sleep(0.005)
    return proc


def released_after(box: Sandbox, end_daemon: Callable[[Sandbox], int]) -> float:
    """Seconds from what `end_daemon` returns (a CLOCK_MONOTONIC ns) to the held
    launch's completion, as the workload's exit shows it."""
    proc = held_launch(box)
    since = end_daemon(box)
    out, err = proc.communicate(timeout=60)
    done = time.monotonic_ns()
    if not out.endswith("launch 1 rc=0\n"):
        raise RuntimeError(f"the held launch failed: {out}{err}")
    return (done - since) / 1e9


def stop_stamping(box: Sandbox) -> int:
    """The daemon killed: no more stamps; the last one's time."""
    box.stop_heartbeat()
    assert box.region is not None
    return box.region.heartbeat_ns


def say_gone(box: Sandbox) -> int:
    """The daemon stopped: heartbeat 0."""
    box.stop_heartbeat()
    assert box.region is not None
    box.region.heartbeat(0)
    return time.monotonic_ns()


def gate_rounds(built: Built, tmp: Path, rounds: int, timeout_ns: int,
                end_daemon: Callable[[Sandbox], int]) -> list[float]:
    times = []
    for round_ in range(rounds):
        box = Sandbox(built, tmp / f"gate-{timeout_ns}-{end_daemon.__name__}-{round_}")
        box.tmp.mkdir()
        try:
            box.make_region(1 << 30, gate_timeout_ns=timeout_ns)
            box.start_heartbeat()
            time.sleep(0.1)  # a few stamps, as a running daemon has made
            times.append(released_after(box, end_daemon))
        finally:
            box.close()
    return times


def queued(box: Sandbox, env: dict[str, str]) -> tuple[int, float]:
    """`workload queue 40 sleep_5000 null`: launches queued as its loop ended, sync ms."""
    args = [str(box.built.workload), "queue", "40", f"sleep_{KERNEL_US}", "null"]
    out = subprocess.run(args, env={**box.env(), **env}, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    fields = dict(item.split("=") for item in out.split()[3:])
    return int(fields["queued"]), float(fields["sync_ms"])


def drained_ms(box: Sandbox, bound: int) -> float:
    """A flood of 150 kernels of 5 ms, its gate closed once 32 are launched: ms from
    the close to the watcher's answer (or to the process's end, without a watcher)."""
    region = region_mod.Region.create(box.region_path, "bench",
                                      [region_mod.GpuSpec(0, UUID, 0, 0, max_inflight=bound)],
                                      gates_open=True)
    box.region = region
    box.start_heartbeat()
    proc = box.popen([str(box.built.workload), "queue", "150", f"sleep_{KERNEL_US}", "null"])
    try:
        while region.activity(0).launches < 32 and proc.poll() is None:
            time.sleep(0.002)
        closed = time.monotonic_ns()
        region.set_gate(0, False)
        seq = region.close_seq(0)
        while proc.poll() is None:
            lines = [region.slot_gpu(slot, 0) for slot in region.live_slots()]
            watching = [line for line in lines if line.watching]
            if watching and all(line.drained_seq == seq for line in watching):
                return (max(int(line.drained_ns) for line in watching) - closed) / 1e6
            time.sleep(0.001)
        return (time.monotonic_ns() - closed) / 1e6
    finally:
        region.set_gate(0, True)
        proc.communicate(timeout=60)
        box.close()


def spread(values: Sequence[float], unit: str, scale: float = 1.0) -> str:
    scaled = [v * scale for v in values]
    return (f"median {statistics.median(scaled):.2f} {unit}, "
            f"min {min(scaled):.2f}, max {max(scaled):.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cgpu-deadlines-") as name:
        tmp = Path(name)
        built = build(tmp)
        print("deadlines: libcgpu on simgpu, a heartbeat thread as the daemon; "
              f"{args.rounds} rounds each")
        for timeout_ns in (region_mod.DEFAULT_GATE_TIMEOUT_NS, SHORT_TIMEOUT_NS):
            times = gate_rounds(built, tmp, args.rounds, timeout_ns, stop_stamping)
            print(f"fail open, gate timeout {timeout_ns / 1e9:g} s: released after the last "
                  f"heartbeat: {spread(times, 's')}")
        times = gate_rounds(built, tmp, args.rounds, region_mod.DEFAULT_GATE_TIMEOUT_NS,
                            say_gone)
        print(f"said gone (heartbeat 0): released after it: {spread(times, 'ms', 1000)}")
        env: dict[str, str]
        for label, env in ((f"max_inflight {region_mod.DEFAULT_MAX_INFLIGHT}", {}),
                           ("unbounded", {"CGPU_MAX_INFLIGHT": "0"})):
            box = Sandbox(built, tmp / f"queue-{label.split()[-1]}")
            box.tmp.mkdir()
            box.make_region(0)
            runs = [queued(box, env) for _ in range(args.rounds)]
            box.close()
            print(f"in flight, {label}: 40 launches of {KERNEL_US // 1000} ms, queued as the "
                  f"loop ended {statistics.median(r[0] for r in runs):.0f}, sync "
                  f"{spread([r[1] for r in runs], 'ms')}")
        for bound, label in ((region_mod.DEFAULT_MAX_INFLIGHT,
                              f"max_inflight {region_mod.DEFAULT_MAX_INFLIGHT}"),
                             (0, "unbounded")):
            times = []
            for round_ in range(args.rounds):
                box = Sandbox(built, tmp / f"drain-{bound}-{round_}")
                box.tmp.mkdir()
                times.append(drained_ms(box, bound))
            print(f"drain after a close, {label}: {spread(times, 'ms')} "
                  f"({KERNEL_US // 1000} ms kernels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
