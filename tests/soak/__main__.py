"""The soak: a simulated 8-GPU node under churn, live writes and faults.

    python -m tests.soak [--minutes N] [--seed S] [--gpus G] [--out DIR]

Containers start and stop all the time through Docker (with
cgpu-container-runtime) and runc (with cgpu-hook), each probing its memory
limit and counting its kernels; the control tree is written live; the
daemon is SIGKILLed and restarted, hot-updated, cgpu-fuse is killed and
remounted, a workload is SIGKILLed while it launches, an OOM script hangs,
a process launches past libcgpu. On every GPU a pair of workloads counts the
kernels it completes: the shares. The plan is a pure function of the seed
(`tests.soak.plan`). Prints a table and writes `soak.csv`, `table.txt` and
`soak.png` (with matplotlib, the `bench` extra) under `--out` (build/soak).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.attacks.node import missing
from tests.soak import report
from tests.soak.runner import run_plan

REPO = Path(__file__).resolve().parents[2]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / "build" / "soak")
    args = parser.parse_args(argv)
    why = missing()
    if why is not None:
        print(f"soak skipped: {why}")
        return 0
    seconds = args.minutes * 60
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"soak: {seconds:g} s on {args.gpus} simulated GPUs, seed {args.seed}", flush=True)
    # SIGTERM as Ctrl-C: the node is taken down (engines, mounts, containers) either way
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        _events, record = run_plan(args.seed, seconds, args.gpus, args.out)
    except KeyboardInterrupt:
        print("soak interrupted: the node is taken down, nothing measured", flush=True)
        return 130
    summary = report.summarize(record)
    text = report.table(summary)
    print(text)
    for line in summary.broken + summary.refused[:20]:
        print(f"  {line}")
    for fault in record.faults:
        if fault.note:
            print(f"  {fault.kind} at {fault.at:.1f} s: {fault.note}")
    for kind, left in summary.leftovers.items():
        if left:
            print(f"  left behind, {kind}: {' '.join(left[:10])}")
    for at, line in summary.errors[:20]:
        print(f"  error at {at:.0f} s: {line}")
    for line in summary.hook_errors[:20]:
        print(f"  hook error at a stop: {line}")
    for w in sorted(summary.windows, key=lambda w: -abs(w.error))[:8]:
        if not w.held:
            late = "" if w.late_ms is None else f", dispatcher late {w.late_ms:.2f} ms"
            shown = f" (not judged: {w.unjudged})" if w.unjudged else ""
            print(f"  GPU {w.gpu} at {w.start:.1f} s, {w.seconds:.1f} s: {w.kernels[1]} / "
                  f"{w.kernels[0]} kernels, {100 * w.error:+.1f}% off 1:{w.expected:g}; "
                  f"{w.audits} audits{late}{shown}")
    for line in report.write_outputs(record, summary, args.out):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
