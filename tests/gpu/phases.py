"""Measuring windows shared by several worker processes, synchronized through files.

The coordinator (`harness.py`) writes a plan, `plan.json` in the sync folder:
a list of phases `{"batch": B, "workers": [names]}`. For each phase i, every
worker named in it

1. runs one step at batch B (compilation, autotuning), then writes `ready-i-NAME`;
2. keeps stepping until the coordinator writes `go-i` (after every worker is
   ready and its warm-up time has passed): `{"start": T, "window": W}` in
   wall-clock seconds, the same for everyone;
3. keeps stepping through [T, T+W] and writes `result-i-NAME`: the steps
   that completed inside the window and their completion times' span.

A worker not named in phase i waits, idle, for `done-i`. So the GPU load is
continuous from the first ready to the end of the window, and every worker's
window is the same interval of time.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BARRIER_TIMEOUT = 300.0  # seconds a worker waits for the coordinator before giving up
NOTES: dict[str, Any] = {}  # what the worker wants recorded with its next result


class PhaseError(RuntimeError):
    pass


def write_json(path: Path, data: Any) -> None:
    """Write atomically (readers poll for the file)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(json.dumps(data))
    os.replace(temporary, path)


def read_plan(sync: Path) -> list[dict[str, Any]]:
    plan = json.loads((sync / "plan.json").read_text())
    if not isinstance(plan, list):
        raise PhaseError("plan.json is not a list of phases")
    return plan


def wait_for(path: Path, what: str, timeout: float = BARRIER_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise PhaseError(f"no {what} ({path.name}) within {timeout:.0f} s")
        time.sleep(0.01)


def measure(sync: Path, index: int, name: str, batch: int, step: Callable[[], None]) -> None:
    """One phase: ready, step until go, count the steps that complete in the window."""
    step()
    write_json(sync / f"ready-{index}-{name}", {"pid": os.getpid(), "time": time.time()})
    go = sync / f"go-{index}"
    deadline = time.monotonic() + BARRIER_TIMEOUT
    while not go.exists():
        if time.monotonic() > deadline:
            raise PhaseError(f"no go for phase {index} within {BARRIER_TIMEOUT:.0f} s")
        step()
    order = json.loads(go.read_text())
    start, end = float(order["start"]), float(order["start"]) + float(order["window"])
    while time.time() < start:
        step()
    completions: list[float] = []
    while True:
        step()
        now = time.time()
        if now > end:
            break
        completions.append(now)
    steps = len(completions)
    # Steps per second between the first and the last completion in the window:
    # the partial steps at both ends do not bias it.
    span = completions[-1] - completions[0] if steps >= 2 else 0.0
    rate = (steps - 1) / span if span > 0 else 0.0
    write_json(sync / f"result-{index}-{name}", {
        "pid": os.getpid(), "batch": batch, "steps": steps, "span": span,
        "steps_per_s": rate, "images_per_s": rate * batch, **NOTES,
    })


def run_plan(sync: Path, name: str, make_step: Callable[[int], Callable[[], None]]) -> int:
    """Run every phase of the plan for worker `name`; `make_step(batch)` builds a step."""
    plan = read_plan(sync)
    for index, phase in enumerate(plan):
        if name in phase["workers"]:
            batch = int(phase["batch"])
            measure(sync, index, name, batch, make_step(batch))
        else:
            wait_for(sync / f"done-{index}", f"end of phase {index}")
    return 0


def worker_main(name: str, sync: Path, make_step: Callable[[int], Callable[[], None]]) -> int:
    """The common tail of a worker: run the plan, report a failure in one line."""
    try:
        return run_plan(sync, name, make_step)
    except Exception as error:
        write_json(sync / f"failed-{name}", {"pid": os.getpid(), "error": repr(error)})
        print(f"worker {name}: {error!r}", flush=True)
        return 1
