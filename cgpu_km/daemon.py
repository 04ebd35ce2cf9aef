"""cgpu-daemon: the host daemon (trio) that turns the control tree into GPU slices.

Responsibilities, each its own task with its own worker thread (one slow
service never holds up another; see `Daemon.run`):

- tree: inotify says which nodes were written, so `echo 2 > <root>/0/policy`
  acts within one period; a slow poll (`--tree-refresh`, `--full-refresh`)
  is the safety net, and without inotify the GPU nodes are polled every
  period; SIGHUP re-reads everything; `upgrade` is watched too. A new
  container's region is attached when the tree lists it (and looked for
  every period until it is there). A `memsize` written in the tree goes into
  the container's region at once (live memory limits).
- scheduling: the data plane runs one dispatcher thread per GPU
  (`cgpu_km.dispatch`), which hands the GPU to one container at a time in
  slices and stamps the heartbeat; this daemon only configures them.
- memory: NVML's processes, put into containers by the kernel's view, fed
  into the tree (`meminfo`), and the backstop that stops the processes of a
  container over its limit (each stop a task of its own, with a deadline).
- slots: the process slots of processes the kernel no longer runs are freed.
- publishing: the snapshot for `cgpu-smi` and Prometheus, the state file.
- systemd: READY, WATCHDOG (only while the dispatchers step), RELOADING, STOPPING.

Signals: TERM/INT open every gate, save the state and exit 0; HUP reloads.
Writing 1 to `upgrade` saves the state and re-executes the daemon (same pid,
so systemd keeps tracking it); the new process restores the state, writes
`upgrade` 0 and carries on. After a crash or a restart the daemon reattaches
to the tree and the regions as they are and restores the scheduler credits
from the state file when it is recent.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import trio

from cgpu_km import snapshot as snap
from cgpu_km import treefs
from cgpu_km.backstop import Grandfather, MemoryView, over_limit
from cgpu_km.daemon_io import FsTree, GpuNodes, Key, Plane, QuickView, Tree, Watcher
from cgpu_km.gpus import GpuInfo
from cgpu_km.sched import ContainerSpec, GpuConfig
from cgpu_km.sdnotify import Notifier, watchdog_interval

log = logging.getLogger("cgpu-daemon")

T = TypeVar("T")
Blocking = Callable[[Callable[[], T]], Awaitable[T]]

STATE_FORMAT = 1
STATE_NAME = "daemon-state.json"
UPGRADED_ENV = "CGPU_DAEMON_UPGRADED"
# Achieved utilization in the snapshot: GPU time per second over this many seconds.
UTILIZATION_WINDOW = 5.0
# Scheduler credits older than this are not restored (the world moved on).
STATE_MAX_AGE = 60.0
DISPATCH_SWITCH_INTERVAL = 0.0002  # seconds, sys.setswitchinterval


@dataclass(frozen=True)
class Settings:
    """Timing knobs (seconds)."""

    period: float = 0.1  # tree polls without inotify, and the look for new regions
    slice: float = 0.02  # the scheduling quantum: one container's turn on a GPU (about)
    tree_refresh: float = 5.0  # poll of the GPU nodes while inotify watches the tree
    full_refresh: float = 30.0  # every container's nodes, in case a change was missed
    memory_interval: float = 0.5
    reclaim_interval: float = 1.0  # the kernel is asked which slots' processes are gone
    publish_interval: float = 2.0  # snapshot for cgpu-smi and /metrics
    save_interval: float = 5.0  # state file (also written on exit and before a hot update)
    stop_deadline: float = 15.0  # a stop (OOM script, then SIGKILL) is given up after this

    def __post_init__(self) -> None:
        for name in ("period", "slice", "tree_refresh", "full_refresh", "memory_interval",
                     "reclaim_interval", "publish_interval", "save_interval", "stop_deadline"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")


def gpu_config(nodes: GpuNodes, specs: Mapping[str, ContainerSpec]) -> GpuConfig:
    return GpuConfig(
        policy=nodes.policy,  # type: ignore[arg-type]  # GpuConfig converts and checks
        max_inst=nodes.max_inst,
        prio_ratio=nodes.prio_ratio,
        containers={n: specs.get(n, ContainerSpec(weight=0)) for n in sorted(nodes.containers)},
    )


@dataclass
class DaemonView:
    """What the daemon knows of the tree (merged from quick polls and full reads)."""

    nodes: dict[int, GpuNodes] = field(default_factory=dict)
    specs: dict[Key, ContainerSpec] = field(default_factory=dict)
    memsize: dict[Key, int] = field(default_factory=dict)
    ids: dict[Key, int] = field(default_factory=dict)

    def config(self, gpu: int) -> GpuConfig:
        nodes = self.nodes[gpu]
        specs = {n: s for (g, n), s in self.specs.items() if g == gpu}
        return gpu_config(nodes, specs)


SERVICES = ("tree", "regions", "memory", "meminfo", "slots", "publish")


class Daemon:
    """The daemon's state and services; `run` is the whole program minus argv."""

    def __init__(
        self,
        tree: Tree,
        plane: Plane,
        *,
        state_dir: Path,
        settings: Settings | None = None,
        notifier: Notifier | None = None,
        blocking: Blocking[Any] | None = None,
        wall_clock: Callable[[], float] = time.time,
        restart: Callable[[], None] | None = None,
        gpu_info: Mapping[int, GpuInfo] | None = None,
        publish: Callable[[snap.Snapshot], None] | None = None,
    ) -> None:
        """`blocking` runs every blocking call (tests pass one that runs inline);
        without it each service has a worker thread of its own."""
        self.tree = tree
        self.plane = plane
        self.state_dir = state_dir
        self.settings = settings or Settings()
        self.notifier = notifier or Notifier({})
        self.wall_clock = wall_clock
        self.restart = restart
        self._inline = blocking
        self._limiters = {name: trio.CapacityLimiter(1) for name in SERVICES}
        self._stops = trio.CapacityLimiter(4)
        self.view = DaemonView()
        self.scheduled: set[int] = set()
        self.limits: dict[Key, int] = {}
        self.fed_meminfo: dict[Key, dict[int, int]] = {}
        self.upgrading = False
        self._saved_state: dict[str, Any] | None = None
        self._tree_error: str | None = None
        self.watcher: Watcher | None = None
        self.gpu_info = dict(gpu_info or {})
        self.version = ""
        self.publish = publish
        self.started = wall_clock()
        self.utilization: dict[Key, float] = {}
        self._usage_history: collections.deque[tuple[float, dict[Key, float]]] = (
            collections.deque())
        self.memory = MemoryView(by_container={})
        self.grandfather = Grandfather()
        self.lowered: set[Key] = set()
        self.stopping: set[tuple[Key, int]] = set()
        self.stopped: dict[Key, int] = {}

    async def _run(self, service: str, fn: Callable[[], T]) -> T:
        """A blocking call of one service, in that service's worker thread."""
        if self._inline is not None:
            result: T = await self._inline(fn)
            return result
        return await trio.to_thread.run_sync(fn, limiter=self._limiters[service])

    # -- the tree ------------------------------------------------------------

    async def _read_container(self, gpu: int, name: str) -> bool:
        """Read one container's nodes into the view; False when it is gone."""
        try:
            nodes = await self._run("tree", partial(self.tree.read_container, gpu, name))
        except FileNotFoundError:
            return False
        self.view.specs[gpu, name] = ContainerSpec(
            weight=nodes.weight, highprio=bool(nodes.highprio), util_limit=nodes.util_limit
        )
        self.view.memsize[gpu, name] = nodes.memsize
        self.view.ids[gpu, name] = nodes.id
        return True

    async def _refresh(self, quick: QuickView, *, every_container: bool = False) -> None:
        """Merge a quick read: read the containers that appeared (or all of them),
        forget those that left, reattach the regions, apply."""
        old = self.view.nodes
        self.view.nodes = dict(quick.gpus)
        came_or_went = set(old) != set(quick.gpus) or any(
            old[g].containers != quick.gpus[g].containers for g in quick.gpus
        )
        for gpu, nodes in quick.gpus.items():
            known = old[gpu].containers if gpu in old else frozenset()
            for name in sorted(nodes.containers if every_container
                               else nodes.containers - known):
                await self._read_container(gpu, name)
        present = {(g, n) for g, nodes in quick.gpus.items() for n in nodes.containers}
        for table in (self.view.specs, self.view.memsize, self.view.ids):
            for key in set(table) - present:
                del table[key]
        if came_or_went or every_container:
            names = {g: set(nodes.containers) for g, nodes in quick.gpus.items()}
            await self._run("regions", partial(self.plane.attach, names))
            if self.watcher is not None:
                self.watcher.sync(self.view.nodes)
        self._apply()

    async def _read_all(self) -> None:
        """Every node of the tree (start, SIGHUP, and the slow safety sweep)."""
        quick = await self._run("tree", partial(self.tree.read_quick, True))
        self.version = quick.version
        await self._refresh(quick, every_container=True)

    def _apply(self) -> None:
        """Push the view into the data plane: each GPU's configuration to its
        dispatcher (started on first use), each container's memsize to its region."""
        for index in self.scheduled - set(self.view.nodes):
            self.plane.forget_gpu(index)
        self.scheduled &= set(self.view.nodes)
        for index in self.view.nodes:
            saved = (self._saved_state or {}).get("gpus", {}).get(str(index))
            self.plane.schedule(index, self.view.config(index),
                                saved if index not in self.scheduled else None)
            self.scheduled.add(index)
        for key, memsize in self.view.memsize.items():
            before = self.limits.get(key)
            if before != memsize:
                if before is not None and (before == 0 or 0 < memsize < before):
                    self.lowered.add(key)
                self.plane.set_limit(key, memsize)
                self.limits[key] = memsize
        for key in set(self.limits) - set(self.view.memsize):
            del self.limits[key]

    async def _serve_tree(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                          ) -> None:
        """Read the tree, then follow it: watched changes at once, a poll of the
        GPU nodes every `tree_refresh` and of every container's nodes every
        `full_refresh`; without a watcher, every period and every `tree_refresh`."""
        period = self.settings.period
        while True:
            try:
                await self._read_all()
                break
            except OSError as error:
                self._note_tree_error(error)
                await trio.sleep(period)
        self._note_tree_ok()
        await self._finish_upgrade_if_restarted()
        async with trio.open_nursery() as nursery:
            if self.watcher is not None:
                nursery.start_soon(self._serve_watch, self.watcher)
            task_status.started()
            # Without a watcher: GPU nodes every period, containers every tree_refresh.
            watching = self.watcher is not None
            poll = self.settings.tree_refresh if watching else period
            full = self.settings.full_refresh if watching else self.settings.tree_refresh
            next_full = trio.current_time() + full
            deadline = trio.current_time()
            while True:
                deadline += poll
                await trio.sleep_until(deadline)
                try:
                    if trio.current_time() >= next_full:
                        next_full = trio.current_time() + full
                        await self._read_all()
                    else:
                        await self._poll()
                    self._note_tree_ok()
                except OSError as error:
                    self._note_tree_error(error)

    async def _poll(self) -> None:
        quick = await self._run("tree", self.tree.read_quick)
        await self._refresh(quick)
        if quick.upgrade == 1 and self.restart is not None and not self.upgrading:
            await self._upgrade()

    async def _poll_names(self) -> None:
        names = await self._run("tree", self.tree.read_names)
        if set(names) != set(self.view.nodes):
            await self._poll()
            return
        if all(names[g] == self.view.nodes[g].containers for g in names):
            return
        await self._refresh(QuickView(upgrade=0, gpus={
            g: replace(nodes, containers=names[g]) for g, nodes in self.view.nodes.items()
        }))

    async def _serve_watch(self, watcher: Watcher) -> None:
        """Apply written nodes as soon as the tree says they were written."""
        while True:
            await trio.lowlevel.wait_readable(watcher.fileno())
            changes = watcher.changes()
            try:
                if any(c.name is None and c.node != "inst_ctl" for c in changes):
                    await self._poll()  # a GPU node or upgrade: rare, read them all
                elif any(c.node == "inst_ctl" for c in changes):
                    # Containers may have come or gone; most often it is only our
                    # own meminfo feed, so list the names, nothing more.
                    await self._poll_names()
                changed = {(c.gpu, c.name) for c in changes
                           if c.gpu is not None and c.name is not None}
                for gpu, name in sorted(changed):
                    if (gpu, name) in self.view.specs:
                        await self._read_container(gpu, name)
                if changed:
                    self._apply()
                watcher.sync(self.view.nodes)  # re-watch replaced files (cheap otherwise)
            except OSError as error:
                self._note_tree_error(error)

    def _note_tree_error(self, error: OSError) -> None:
        message = f"cannot read the control tree: {error}"
        if message != self._tree_error:
            log.error("%s", message)
            self._tree_error = message

    def _note_tree_ok(self) -> None:
        if self._tree_error is not None:
            log.info("control tree readable again")
            self._tree_error = None

    async def reload(self) -> None:
        """SIGHUP: re-read the whole tree and reattach the regions."""
        self.notifier.reloading(time.monotonic_ns() // 1000)
        try:
            await self._read_all()
            log.info("reloaded: %d GPUs, %d containers", len(self.view.nodes), len(self.view.specs))
        except OSError as error:
            self._note_tree_error(error)
        self.notifier.ready(self._status())

    # -- regions: new containers' regions, freed slots -------------------------

    async def _serve_regions(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Every period: attach the regions of listed containers that had none
        (the hook and cgpu-run register before they create the region)."""
        task_status.started()
        deadline = trio.current_time()
        while True:
            deadline += self.settings.period
            await trio.sleep_until(deadline)
            missing: set[str] = await self._run("regions", self.plane.missing)
            if self.view.nodes and missing:
                names = {g: set(nodes.containers) for g, nodes in self.view.nodes.items()}
                await self._run("regions", partial(self.plane.attach, names))

    async def _serve_slots(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Every reclaim interval: free the slots of processes that are gone."""
        task_status.started()
        deadline = trio.current_time()
        while True:
            deadline += self.settings.reclaim_interval
            await trio.sleep_until(deadline)
            try:
                await self._run("slots", self.plane.reclaim)
            except OSError as error:
                log.warning("cannot reclaim process slots: %s", error)

    # -- memory: meminfo feed and backstop -----------------------------------

    async def _serve_memory(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with trio.open_nursery() as stops:
            task_status.started()
            deadline = trio.current_time()
            while True:
                try:
                    memory = await self._run("memory", self.plane.memory)
                except OSError as error:
                    log.warning("cannot read GPU memory: %s", error)
                else:
                    self.memory = memory
                    self._backstop(memory, stops)
                    await self._feed_meminfo(memory)
                deadline += self.settings.memory_interval
                await trio.sleep_until(deadline)

    async def _feed_meminfo(self, memory: MemoryView) -> None:
        for key in list(self.view.specs):  # the tree task may change it while we await
            found = memory.by_container.get(key)
            procs = dict(found.procs) if found is not None else {}
            if self.fed_meminfo.get(key) == procs:
                continue
            try:
                await self._run("meminfo", partial(self.tree.feed_meminfo, key[0], key[1], procs))
            except OSError as error:
                log.debug("meminfo %s on GPU %d not fed: %s", key[1], key[0], error)
                continue
            self.fed_meminfo[key] = procs
        for key in set(self.fed_meminfo) - set(self.view.specs):
            del self.fed_meminfo[key]

    def _backstop(self, memory: MemoryView, stops: trio.Nursery) -> None:
        """Stop the largest processes of every container over its limit, each in a
        task of its own. A limit lowered below what a cGPU container holds leaves
        it what it held until its use falls under (eGPU: the operator asked for
        the OOM script and the stop)."""
        lowered, self.lowered = self.lowered, set()
        for key, found in memory.by_container.items():
            limit = self.view.memsize.get(key, 0)
            if not self.plane.egpu(key):
                limit = self.grandfather.limit(key, limit, found.total, key in lowered)
            over = [pid for pid in over_limit(found.procs, limit)
                    if (key, pid) not in self.stopping]
            if not over:
                continue
            log.warning("container %s on GPU %d holds %d bytes over its limit of %d: "
                        "stopping pids %s", key[1], key[0], found.total - limit, limit,
                        " ".join(map(str, over)))
            for pid in over:
                self.stopping.add((key, pid))
                stops.start_soon(self._stop, key, pid)
        self.grandfather.forget(set(memory.by_container))

    async def _stop(self, key: Key, pid: int) -> None:
        try:
            with trio.move_on_after(self.settings.stop_deadline) as scope:
                if self._inline is not None:
                    await self._inline(partial(self.plane.stop, key, pid))
                else:
                    await trio.to_thread.run_sync(partial(self.plane.stop, key, pid),
                                                  limiter=self._stops,
                                                  abandon_on_cancel=True)
            if scope.cancelled_caught:
                log.warning("stopping pid %d of %s took over %.0f s", pid, key[1],
                            self.settings.stop_deadline)
            self.stopped[key] = self.stopped.get(key, 0) + 1
        finally:
            self.stopping.discard((key, pid))

    # -- publishing, state, systemd ------------------------------------------

    def state_path(self) -> Path:
        return self.state_dir / STATE_NAME

    def state(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "pid": os.getpid(),
            "saved": self.wall_clock(),
            "gpus": {str(i): self.plane.scheduler_state(i) for i in sorted(self.scheduled)},
        }

    def save_state(self) -> None:
        self._write_state(self.state())

    def _write_state(self, state: dict[str, Any]) -> None:
        path = self.state_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(state, sort_keys=True))
        os.replace(temporary, path)

    def load_state(self) -> None:
        """Take the previous daemon's credits, if its state file is recent and sound."""
        try:
            data = json.loads(self.state_path().read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as error:
            log.warning("ignoring state file %s: %s", self.state_path(), error)
            return
        if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
            log.warning("ignoring state file %s: unknown format", self.state_path())
            return
        age = self.wall_clock() - float(data.get("saved", 0))
        if not 0 <= age <= STATE_MAX_AGE:
            log.info("state file is %.0f s old: starting with fresh credits", age)
            return
        self._saved_state = data
        log.info("restored scheduler state saved %.1f s ago", age)

    def _gpu_time(self) -> dict[Key, float]:
        """GPU seconds each container was charged by its GPU's dispatcher."""
        return {(gpu, name): used for gpu, figures in self.plane.figures().items()
                for name, used in figures.used.items()}

    def _utilization_since(self, now: float, usage: dict[Key, float]) -> dict[Key, float]:
        """Each container's GPU time per second over the last UTILIZATION_WINDOW (0..1)."""
        history = self._usage_history
        while history and now - history[0][0] > UTILIZATION_WINDOW:
            history.popleft()
        base = history[0] if history else None
        history.append((now, usage))
        if base is None or now <= base[0]:
            return {}
        then, before = base
        return {key: min(1.0, max(0.0, used - before.get(key, used)) / (now - then))
                for key, used in usage.items()}

    def snapshot(self) -> snap.Snapshot:
        """The figures `cgpu-smi` and Prometheus show, frozen now."""
        now = self.wall_clock()
        usage = self._gpu_time()
        figures = self.plane.figures()
        self.utilization = self._utilization_since(now, usage)
        gpus = []
        containers = []
        for index in sorted(self.view.nodes):
            nodes = self.view.nodes[index]
            info = self.gpu_info.get(index)
            total = info.memory_total if info else 0
            shares = figures[index].shares if index in figures else {}
            used_gpu = self.memory.used_by_gpu.get(index)
            weights = sum(self.view.specs[index, n].weight for n in nodes.containers
                          if (index, n) in self.view.specs)
            gpus.append(snap.GpuFigures(
                index=index, uuid=info.uuid if info else "", name=info.name if info else "",
                memory_total_bytes=total, memory_used_bytes=used_gpu,
                utilization=min(1.0, sum(self.utilization.get((index, n), 0.0)
                                         for n in nodes.containers)),
                policy=nodes.policy, max_inst=nodes.max_inst, prio_ratio=nodes.prio_ratio,
                free_weight=max(0, nodes.max_inst - weights),
            ))
            for name in sorted(nodes.containers):
                key = (index, name)
                spec = self.view.specs.get(key)
                if spec is None:
                    continue
                found = self.memory.by_container.get(key)
                procs = found.procs if found is not None else {}
                unmanaged = found.unmanaged if found is not None else frozenset()
                memsize = self.view.memsize.get(key, 0)
                containers.append(snap.ContainerFigures(
                    name=name, id=self.view.ids.get(key, 0), gpu=index, weight=spec.weight,
                    highprio=spec.highprio, util_limit=spec.util_limit,
                    target_share=float(shares.get(name, 0)),
                    utilization=min(1.0, self.utilization.get(key, 0.0)),
                    memory_used_bytes=sum(procs.values()),
                    memory_limit_bytes=memsize or total,
                    gpu_time_seconds=usage.get(key, 0.0),
                    gate_wait_seconds=self.memory.gate_wait.get(key, 0.0),
                    oom_events=self.memory.oom_refusals.get(key, 0) + self.stopped.get(key, 0),
                    processes=tuple(snap.ProcessFigures(pid, size, pid not in unmanaged)
                                    for pid, size in sorted(procs.items())),
                ))
        return snap.Snapshot(
            version=self.version, pid=os.getpid(), period_seconds=self.settings.period,
            timestamp=now, started=self.started,
            gpus=tuple(gpus), containers=tuple(containers),
        )

    async def _serve_publish(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        deadline = trio.current_time()
        next_save = deadline + self.settings.publish_interval  # soon after start
        while True:
            if self.publish is not None:
                try:
                    snapshot = self.snapshot()
                    await self._run("publish", partial(self.publish, snapshot))
                except OSError as error:
                    log.warning("cannot publish the snapshot: %s", error)
            deadline += self.settings.publish_interval
            await trio.sleep_until(deadline)
            if trio.current_time() >= next_save:
                next_save = trio.current_time() + self.settings.save_interval
                try:
                    await self._run("publish", self.save_state)
                except OSError as error:
                    log.warning("cannot save state: %s", error)

    async def _serve_watchdog(self, interval: float) -> None:
        deadline = trio.current_time()
        while True:
            deadline += interval
            await trio.sleep_until(deadline)
            # Ping only while the dispatchers step: a stuck daemon gets restarted.
            if self.plane.ticking(within=max(interval * 2, 2.0)):
                self.notifier.watchdog()

    def _status(self) -> str:
        return f"{len(self.view.nodes)} GPUs, {len(self.view.specs)} containers"

    async def _finish_upgrade_if_restarted(self) -> None:
        if os.environ.get(UPGRADED_ENV) != "1":
            return
        os.environ.pop(UPGRADED_ENV, None)
        # systemd's watchdog timer ran on through the exec (same PID, no new start):
        # ping now, not one interval from now, or the exec's time makes it fire.
        if watchdog_interval() is not None:
            self.notifier.watchdog()
        try:
            await self._run("tree", self.tree.finish_upgrade)
            log.info("hot update done")
        except OSError as error:
            log.error("cannot write 0 to upgrade: %s", error)

    async def _upgrade(self) -> None:
        """`upgrade` reads 1: save everything and re-execute (the caller's `restart`)."""
        assert self.restart is not None
        self.upgrading = True
        log.info("hot update requested: re-executing with state kept")
        self.notifier.reloading(time.monotonic_ns() // 1000)
        self.save_state()
        os.environ[UPGRADED_ENV] = "1"
        if watchdog_interval() is not None:
            self.notifier.watchdog()  # the exec's time starts from a fresh ping
        self.restart()

    # -- the whole -----------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every service, report READY, and run until cancelled; fail open on the way out."""
        self.load_state()
        self.watcher = self.tree.watcher()
        try:
            async with trio.open_nursery() as services:
                await services.start(self._serve_tree)
                await services.start(self._serve_regions)
                await services.start(self._serve_slots)
                await services.start(self._serve_memory)
                await services.start(self._serve_publish)
                interval = watchdog_interval()
                if interval is not None:
                    services.start_soon(self._serve_watchdog, interval)
                self.notifier.ready(self._status())
                log.info("running: %s, slice %.3f s", self._status(), self.settings.slice)
                task_status.started()
        finally:
            if self.watcher is not None:
                self.watcher.close()
                self.watcher = None
            if not self.upgrading:
                self.notifier.stopping()
                self.shutdown()

    def shutdown(self) -> None:
        """Fail open and keep the credits for the next daemon (synchronous, never raises)."""
        state: dict[str, Any] | None = None
        with contextlib.suppress(Exception):
            state = self.state()
        try:
            self.plane.close()
        except Exception as error:  # the gates must open: log whatever failed
            log.error("opening the gates failed: %s", error)
        with contextlib.suppress(OSError):
            if state is not None and self.scheduled:
                self._write_state(state)


async def run_with_signals(daemon: Daemon) -> None:
    """The daemon plus the main task's signal handling: TERM/INT stop, HUP reloads."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(daemon.run)
            async for signum in signals:
                if signum == signal.SIGHUP:
                    nursery.start_soon(daemon.reload)
                    continue
                log.info("%s: opening every gate and exiting", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cgpu-daemon", description=__doc__.splitlines()[0])
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
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="cgpu-daemon: %(message)s", stream=sys.stderr,
    )
    try:
        settings = Settings(period=args.period, slice=args.slice,
                            tree_refresh=args.tree_refresh, full_refresh=args.full_refresh)
    except ValueError as error:
        print(f"cgpu-daemon: {error}", file=sys.stderr)
        return 2
    # A dispatcher woken by a doorbell must not wait for another thread's Python
    # (a /proc scan, NVML) to give up the interpreter: 5 ms by default.
    sys.setswitchinterval(DISPATCH_SWITCH_INTERVAL)
    from cgpu_km import metrics
    from cgpu_km.daemon_plane import make_plane
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
    plane = make_plane(args.region_dir, quantum=settings.slice)
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

    daemon = Daemon(FsTree(root), plane, state_dir=state_dir, settings=settings,
                    notifier=Notifier(), restart=restart, gpu_info=gpu_info, publish=publish)
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(run_with_signals, daemon)
    return 0


if __name__ == "__main__":
    sys.exit(main())
