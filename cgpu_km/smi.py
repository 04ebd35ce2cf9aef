"""`cgpu-smi`: per-GPU and per-container view of a shared GPU node, like `nvidia-smi`.

It merges two sources:

- the control tree (`--root`), always: the live configuration (policy,
  max_inst, weights, memory limits) and the processes in `meminfo`;
- the daemon's snapshot (`--state-dir`, see cgpu_km.daemon.snapshot): GPU names
  and UUIDs, usage, target shares, achieved utilization and counters.

The daemon counts as running when the snapshot's pid is alive and the
snapshot is fresh. Otherwise the view says that the daemon is not running
and shows what the tree knows; GPU names then come from a stale snapshot,
or from NVML, or are left unknown.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgpu_km import __version__
from cgpu_km.daemon.snapshot import (
    ProcessFigures,
    Snapshot,
    SnapshotError,
    pid_alive,
    read_snapshot,
    resolve_state_dir,
    snapshot_path,
)
from cgpu_km.tree import client as treefs

POLICY_NAMES = ("fair-share", "preemptive", "weighted", "fixed", "soft", "native")
MIB = 1 << 20


@dataclass(frozen=True)
class Identity:
    """What NVML or the snapshot says a GPU is."""

    uuid: str
    name: str
    memory_total_bytes: int


@dataclass(frozen=True)
class DaemonStatus:
    running: bool
    reason: str  # why it is not running, or ""
    pid: int | None = None
    version: str | None = None
    period_seconds: float | None = None
    snapshot_age_seconds: float | None = None


@dataclass(frozen=True)
class ContainerRow:
    name: str
    id: int
    gpu: int
    weight: int
    highprio: bool
    util_limit: int
    memory_limit_bytes: int | None  # None: the whole device, whose size is unknown
    memory_used_bytes: int
    processes: tuple[ProcessFigures, ...]
    # Live figures: None unless the daemon is running.
    target_share: float | None = None
    utilization: float | None = None
    gpu_time_seconds: float | None = None
    gate_wait_seconds: float | None = None
    oom_events: int | None = None
    bypass_stops: int | None = None
    overuse_stops: int | None = None


@dataclass(frozen=True)
class GpuRow:
    index: int
    uuid: str | None
    name: str | None
    memory_total_bytes: int | None
    policy: int
    max_inst: int
    prio_ratio: int
    free_weight: int
    containers: tuple[ContainerRow, ...]
    memory_used_bytes: int | None = None
    utilization: float | None = None


@dataclass(frozen=True)
class View:
    time: float
    tree_root: str
    tree_version: str
    daemon: DaemonStatus
    gpus: tuple[GpuRow, ...]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def daemon_status(snapshot: Snapshot | None, problem: str, now: float) -> DaemonStatus:
    """Running: the snapshot's pid is alive and the snapshot is fresh."""
    if snapshot is None:
        return DaemonStatus(False, problem or "no snapshot")
    age = snapshot.age(now)
    if not pid_alive(snapshot.pid):
        reason = f"pid {snapshot.pid} is gone"
    elif not snapshot.is_fresh(now):
        reason = f"its last snapshot is {age:.0f} s old"
    else:
        reason = ""
    return DaemonStatus(running=not reason, reason=reason, pid=snapshot.pid,
                        version=snapshot.version, period_seconds=snapshot.period_seconds,
                        snapshot_age_seconds=round(age, 3))


def _container_row(gpu: int, view: treefs.ContainerView, total: int | None,
                   live: Snapshot | None) -> ContainerRow:
    figures = live.container(gpu, view.name) if live else None
    bypassed = {p.pid for p in figures.processes if not p.managed} if figures else set()
    processes = tuple(ProcessFigures(pid, size, pid not in bypassed)
                      for pid, size in sorted(view.procs.items()))
    row = ContainerRow(
        name=view.name, id=view.id, gpu=gpu, weight=view.weight,
        highprio=bool(view.highprio), util_limit=view.util_limit,
        memory_limit_bytes=view.memsize or total,
        memory_used_bytes=sum(view.procs.values()), processes=processes,
    )
    if figures is None:
        return row
    return dataclasses.replace(
        row, target_share=figures.target_share, utilization=figures.utilization,
        gpu_time_seconds=figures.gpu_time_seconds, gate_wait_seconds=figures.gate_wait_seconds,
        oom_events=figures.oom_events, bypass_stops=figures.bypass_stops,
        overuse_stops=figures.overuse_stops)


def build_view(tree: treefs.TreeView, root: str, snapshot: Snapshot | None,
               status: DaemonStatus, identities: dict[int, Identity], now: float) -> View:
    """Merge the tree (configuration), identities and, when running, the snapshot's figures."""
    live = snapshot if status.running else None
    rows = []
    for gpu in tree.gpus:
        ident = identities.get(gpu.index)
        total = (ident.memory_total_bytes or None) if ident else None
        figures = live.gpu(gpu.index) if live else None
        rows.append(GpuRow(
            index=gpu.index, uuid=(ident.uuid or None) if ident else None,
            name=(ident.name or None) if ident else None, memory_total_bytes=total,
            policy=gpu.policy, max_inst=gpu.max_inst, prio_ratio=gpu.prio_ratio,
            free_weight=gpu.free_weight,
            containers=tuple(_container_row(gpu.index, c, total, live)
                             for c in gpu.containers.values()),
            memory_used_bytes=figures.memory_used_bytes if figures else None,
            utilization=figures.utilization if figures else None,
        ))
    return View(time=now, tree_root=root, tree_version=tree.version, daemon=status,
                gpus=tuple(rows))


def identities_from_snapshot(snapshot: Snapshot) -> dict[int, Identity]:
    return {g.index: Identity(g.uuid, g.name, g.memory_total_bytes) for g in snapshot.gpus}


def identities_from_nvml() -> dict[int, Identity]:
    """Best effort: GPU names from NVML (or simgpu); empty when NVML cannot tell."""
    from cgpu_km.gpus import GpuError, discover_gpus

    try:
        gpus = discover_gpus()
    except GpuError:
        return {}
    return {g.index: Identity(g.uuid, g.name, g.memory_total) for g in gpus}


def select_gpus(view: View, selectors: Sequence[str]) -> View:
    """Keep the GPUs named by index or UUID; ValueError names an unknown one."""
    if not selectors:
        return view
    wanted = set()
    for selector in selectors:
        match = [g.index for g in view.gpus if selector in (str(g.index), g.uuid)]
        if not match:
            known = ", ".join(str(g.index) for g in view.gpus) or "none"
            raise ValueError(f"-i {selector}: no such GPU (GPUs: {known})")
        wanted.update(match)
    return dataclasses.replace(view, gpus=tuple(g for g in view.gpus if g.index in wanted))


# ---- text rendering -------------------------------------------------------

def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value // MIB}MiB"


def _percent(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value * 100:.{digits}f}%"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _usage(used: int | None, total: int | None) -> str:
    return f"{_mib(used)} / {_mib(total)}"


def _policy(value: int) -> str:
    name = POLICY_NAMES[value] if 0 <= value < len(POLICY_NAMES) else "unknown"
    return f"{value} {name}"


def _text(value: object) -> str:
    return "-" if value is None else str(value)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                 left: Sequence[int] = ()) -> list[str]:
    """A boxed table; columns in `left` are left-aligned, the others right-aligned."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [c.ljust(w) if i in left else c.rjust(w)
                  for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "| " + " | ".join(padded) + " |"

    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    body = [line(r) for r in rows] or ["| " + "(none)".ljust(len(rule) - 4) + " |"]
    return [rule, line(headers), rule.replace("-", "="), *body, rule]


def _daemon_line(status: DaemonStatus) -> str:
    if status.running:
        return (f"Daemon: running (pid {status.pid}, version {status.version}, "
                f"period {status.period_seconds:g} s)")
    return (f"Daemon: NOT RUNNING ({status.reason}); showing what the control tree knows, "
            "without live usage")


def render_text(view: View) -> str:
    stamp = time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(view.time))
    lines = [f"cgpu-smi {__version__}    {stamp}",
             f"Tree: {view.tree_root} (version {view.tree_version})",
             _daemon_line(view.daemon), ""]
    lines += render_table(
        ["GPU", "Name", "Memory-Usage", "Util", "Policy", "MaxInst", "FreeW", "Prio"],
        [[str(g.index), _text(g.name), _usage(g.memory_used_bytes, g.memory_total_bytes),
          _percent(g.utilization), _policy(g.policy),
          str(g.max_inst), str(g.free_weight), f"{g.prio_ratio}%"] for g in view.gpus],
        left=(1, 4))
    containers = [c for g in view.gpus for c in g.containers]
    lines += ["", "Containers:"]
    lines += render_table(
        ["GPU", "Container", "ID", "Weight", "HiPrio", "Target", "Util", "Limit",
         "Memory-Usage", "GPU-Time", "Gate-Wait", "OOM", "BYPASSED", "OVERUSE"],
        [[str(c.gpu), c.name, str(c.id), str(c.weight), "yes" if c.highprio else "no",
          _percent(c.target_share, 1), _percent(c.utilization, 1),
          f"{c.util_limit}%" if c.util_limit else "-",
          _usage(c.memory_used_bytes, c.memory_limit_bytes),
          _seconds(c.gpu_time_seconds), _seconds(c.gate_wait_seconds), _text(c.oom_events),
          _text(c.bypass_stops), _text(c.overuse_stops)]
         for c in containers],
        left=(1,))
    lines += ["", "Processes:"]
    lines += render_table(
        ["GPU", "Container", "PID", "GPU Memory", "libcgpu"],
        [[str(c.gpu), c.name, str(p.pid), _mib(p.memory_bytes),
          "yes" if p.managed else "BYPASSED"]
         for c in containers for p in c.processes],
        left=(1,))
    return "\n".join(lines) + "\n"


def render_list(view: View) -> str:
    """`nvidia-smi -L`: one line per GPU with its UUID."""
    return "".join(f"GPU {g.index}: {g.name or 'unknown'} (UUID: {g.uuid or 'unknown'})\n"
                   for g in view.gpus)


# ---- program --------------------------------------------------------------

def collect_view(root: Path, state_dir: Path,
                 nvml: Callable[[], dict[int, Identity]] = identities_from_nvml) -> View:
    """Read the tree and the snapshot once; OSError when the tree cannot be read."""
    tree = treefs.read_tree(root)
    problem = ""
    try:
        snapshot = read_snapshot(snapshot_path(state_dir))
    except (SnapshotError, OSError) as error:
        snapshot, problem = None, f"unreadable snapshot: {error}"
    if snapshot is None and not problem:
        problem = f"no snapshot in {state_dir}"
    now = time.time()
    status = daemon_status(snapshot, problem, now)
    identities = identities_from_snapshot(snapshot) if snapshot else nvml()
    return build_view(tree, str(root), snapshot, status, identities, now)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="cgpu-smi", description="Show GPUs and containers shared by cgpu_km.")
    parser.add_argument("-L", "--list-gpus", action="store_true",
                        help="list the GPUs with their UUIDs, as nvidia-smi -L does")
    parser.add_argument("-l", "--loop", type=float, metavar="SECONDS",
                        help="repeat every SECONDS until interrupted")
    parser.add_argument("--json", action="store_true", help="print the view as JSON")
    parser.add_argument("-i", "--id", action="append", default=[], metavar="GPU",
                        help="only these GPUs: index or UUID, comma list, repeatable")
    parser.add_argument("--root", help="control tree (default: $CGPU_KM_ROOT, /proc/cgpu_km "
                        "if present, else /run/cgpu_km)")
    parser.add_argument("--state-dir", help="daemon state folder with snapshot.json "
                        "(default: $CGPU_STATE_DIR, else /run/cgpu_km-daemon)")
    args = parser.parse_args(argv)
    if args.loop is not None and not args.loop > 0:
        parser.error(f"-l {args.loop:g}: SECONDS must be positive")
    args.id = [part.strip() for item in args.id for part in item.split(",") if part.strip()]
    return args


def render(view: View, args: argparse.Namespace) -> str:
    if args.json:
        indent = None if args.loop else 1
        return json.dumps(view.to_dict(), indent=indent, sort_keys=True) + "\n"
    return render_list(view) if args.list_gpus else render_text(view)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    root = treefs.resolve_root(args.root)
    state_dir = resolve_state_dir(args.state_dir)
    try:
        while True:
            try:
                view = select_gpus(collect_view(root, state_dir), args.id)
            except OSError as error:
                print(f"cgpu-smi: cannot read the control tree at {root}: "
                      f"{error.strerror or error} (is cgpu-fuse or the cgpu_km module running?)",
                      file=sys.stderr)
                return 1
            except ValueError as error:
                print(f"cgpu-smi: {error}", file=sys.stderr)
                return 2
            sys.stdout.write(render(view, args))
            sys.stdout.flush()
            if args.loop is None:
                return 0
            time.sleep(args.loop)
            if not args.json:
                sys.stdout.write("\n")
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
