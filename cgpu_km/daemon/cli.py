"""`cgpu-daemon`'s command line: options, the GPU probes the units use, and
the program that wires the real tree, data plane, metrics and systemd."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence

import trio

from cgpu_km.daemon import core
from cgpu_km.daemon import snapshot as snap
from cgpu_km.daemon.context import BYPASS_ACTIONS, Settings
from cgpu_km.daemon.lifecycle import UPGRADED_ENV, run_with_signals
from cgpu_km.daemon.sdnotify import Notifier, watchdog_interval
from cgpu_km.tree import client as treefs
from cgpu_km.tree.fstree import FsTree

log = logging.getLogger("cgpu-daemon")

DISPATCH_SWITCH_INTERVAL = 0.0002  # seconds, sys.setswitchinterval


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="cgpu-daemon",
        description="cgpu-daemon: the host daemon (trio) that turns the control tree into GPU "
        "slices.")
    parser.add_argument("--root", help="control tree (default: $CGPU_KM_ROOT, /proc/cgpu_km "
                        "if present, else /run/cgpu_km)")
    parser.add_argument("--state-dir", help="where the state file and the snapshot live "
                        "(default: $CGPU_STATE_DIR, else /run/cgpu_km-daemon)")
    parser.add_argument("--region-dir", help="containers' shared-memory regions "
                        "(default: $CGPU_REGION_DIR, else /run/cgpu_km-regions)")
    parser.add_argument("--period", type=float, default=Settings.period,
                        help="how soon tree changes and new regions are seen without "
                        "inotify, in seconds (default %(default)s)")
    parser.add_argument("--slice", type=float, default=Settings.slice,
                        help="scheduling quantum: the shortest turn of a container on a GPU, "
                        "in seconds (default %(default)s)")
    parser.add_argument("--tree-refresh", type=float, default=Settings.tree_refresh,
                        help="seconds between polls of the GPU nodes while inotify watches "
                        "the tree (without inotify: every period)")
    parser.add_argument("--full-refresh", type=float, default=Settings.full_refresh,
                        help="seconds between re-reads of every container's nodes")
    parser.add_argument("--metrics-listen", "--metrics", dest="metrics", default="off",
                        metavar="HOST:PORT", help="serve Prometheus /metrics on HOST:PORT "
                        "([::1]:PORT for IPv6), or 'off' (default; the service uses "
                        "127.0.0.1:9400)")
    parser.add_argument("--on-bypass", choices=BYPASS_ACTIONS, default=Settings.on_bypass,
                        help="what is done to a process of a managed container that holds "
                        "GPU memory without libcgpu, under policies 0-4: stop it (SIGKILL; "
                        "default) or only report it")
    parser.add_argument("--report-bypass", action="append", default=[], metavar="CONTAINER",
                        help="only report, never stop, the bypassing processes of this "
                        "container (its name in the tree; repeatable)")
    parser.add_argument("--compute-window", type=float, default=Settings.compute_window,
                        help="seconds of NVML's per-process samples over which a container's "
                        "GPU time is weighed against its grants (default %(default)s)")
    parser.add_argument("--compute-tolerance", type=float,
                        default=Settings.compute_tolerance,
                        help="how many times the time it was granted a container's NVML "
                        "samples may add up to before its processes are stopped as those "
                        "that bypass libcgpu are (default %(default)s)")
    parser.add_argument("--audit-every", type=float, default=Settings.audit_every,
                        help="seconds a busy container goes at most without an audit: a "
                        "quiet span in which NVML must see none of its processes run "
                        "(default %(default)s)")
    parser.add_argument("--dispatch-priority", type=int, default=Settings.dispatch_priority,
                        metavar="N", help="the SCHED_FIFO priority of each GPU's dispatcher "
                        "thread, 1-99, or 0 for the default policy (default %(default)s: "
                        "above every process of the default policy, below any other "
                        "real-time thread)")
    parser.add_argument("-v", "--verbose", action="store_true")
    probe = parser.add_mutually_exclusive_group()
    probe.add_argument("--count-gpus", action="store_true",
                       help="print the number of GPUs (NVML, else simgpu) and exit")
    probe.add_argument("--module-params", action="store_true",
                       help="print the kernel module's parameters for this host and exit")
    return parser.parse_args(argv)


def probe_gpus(args: argparse.Namespace) -> int:
    """`--count-gpus` / `--module-params`: what the service units need from NVML.
    No GPU, or no answer from NVML, is an error (one line, status 1): the units
    must not start on a guess."""
    from cgpu_km.gpus import GpuError, discover_gpus

    try:
        found = discover_gpus()
    except GpuError as error:
        print(f"cgpu-daemon: {error}", file=sys.stderr)
        return 1
    if not found:
        # A tree of one made-up GPU would be served as if it were real.
        print("cgpu-daemon: NVML reports no GPUs", file=sys.stderr)
        return 1
    if args.count_gpus:
        print(len(found))
    else:
        sizes = ",".join(str(g.memory_total) for g in found)
        print(f"gpus={len(found)} gpu_mem={sizes}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.count_gpus or args.module_params:
        return probe_gpus(args)
    # CGPU_DAEMON_LOG_LEVELS=1 names each line's level (the soak counts the errors).
    levels = "%(levelname)s: " if os.environ.get("CGPU_DAEMON_LOG_LEVELS") == "1" else ""
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format=f"cgpu-daemon: {levels}%(message)s", stream=sys.stderr,
    )
    try:
        settings = Settings(period=args.period, slice=args.slice,
                            tree_refresh=args.tree_refresh, full_refresh=args.full_refresh,
                            on_bypass=args.on_bypass,
                            compute_window=args.compute_window,
                            compute_tolerance=args.compute_tolerance,
                            audit_every=args.audit_every,
                            dispatch_priority=args.dispatch_priority,
                            report_bypass=frozenset(args.report_bypass))
    except ValueError as error:
        print(f"cgpu-daemon: {error}", file=sys.stderr)
        return 2
    # After a hot update's exec, systemd's watchdog timer runs on from the old
    # process's last ping: ping before the imports and the tree's first read,
    # which take seconds on a slow host (the lifecycle pings again once read).
    if os.environ.get(UPGRADED_ENV) == "1" and watchdog_interval() is not None:
        Notifier().watchdog()
    # A dispatcher woken by a doorbell must not wait for another thread's Python
    # (a /proc scan, NVML) to give up the interpreter: 5 ms by default.
    sys.setswitchinterval(DISPATCH_SWITCH_INTERVAL)
    from cgpu_km.daemon import metrics
    from cgpu_km.dataplane.plane import make_plane
    from cgpu_km.gpus import GpuError, discover_gpus

    try:
        listen = metrics.parse_listen(args.metrics)
    except ValueError as error:
        print(f"cgpu-daemon: {error}", file=sys.stderr)
        return 2
    root = treefs.resolve_root(args.root)
    state_dir = snap.resolve_state_dir(args.state_dir)
    try:
        gpu_info = {g.index: g for g in discover_gpus()}
    except GpuError as error:
        log.warning("%s: GPU names and totals unknown", error)
        gpu_info = {}
    plane = make_plane(args.region_dir, quantum=settings.slice,
                       priority=settings.dispatch_priority)
    holder = metrics.SnapshotHolder()
    server = None
    if listen is not None:
        try:
            server = metrics.serve_metrics(listen.host, listen.port, holder)
            log.info("metrics on http://%s:%d/metrics", listen.host, server.port)
        except OSError as error:
            log.error("cannot serve metrics on %s: %s", args.metrics, error)

    def publish(snapshot: snap.Snapshot) -> None:
        holder.swap(snapshot)
        snap.write_snapshot(snapshot, state_dir / snap.SNAPSHOT_NAME)

    argv_now = list(sys.argv)

    def restart() -> None:
        if server is not None:
            server.close()
        os.execv(sys.executable, [sys.executable, "-m", "cgpu_km.daemon", *argv_now[1:]])

    daemon = core.Daemon(FsTree(root), plane, state_dir=state_dir, settings=settings,
                         notifier=Notifier(), restart=restart, gpu_info=gpu_info,
                         publish=publish)
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(run_with_signals, daemon)
    return 0


if __name__ == "__main__":
    sys.exit(main())
