"""cgpu-daemon: the host daemon (trio) that turns the control tree into gate decisions.

Responsibilities, each its own task or nursery (see `Daemon.run`):

- tree: inotify says which nodes were written, so `echo 2 > <root>/0/policy`
  acts within one period; a slow poll (`--tree-refresh`, `--full-refresh`)
  is the safety net, and without inotify the GPU nodes are polled every
  period; SIGHUP re-reads everything; `upgrade` is watched too.
- scheduling: every period one sample of the data plane (GPU time used and
  activity per container), one `cgpu_km.sched.GateScheduler` step per GPU,
  and the gates that changed set in one trip to the worker thread; plus the
  heartbeat (every `HEARTBEAT_INTERVAL`) that keeps gates from failing open.
- memory: NVML's per-process memory, fed into the tree (`meminfo`), and the
  backstop that stops processes of a container over its limit.
- publishing: the snapshot for `cgpu-smi` and Prometheus, the state file.
- systemd: READY, WATCHDOG (only while the schedulers tick), RELOADING, STOPPING.

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
from cgpu_km.daemon_io import (
    FsTree,
    GpuNodes,
    Key,
    Plane,
    PlaneSample,
    ProcessMemory,
    QuickView,
    Tree,
    Watcher,
)
from cgpu_km.gpus import GpuInfo
from cgpu_km.sched import ContainerSpec, GateDecision, GateScheduler, GpuConfig
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


@dataclass(frozen=True)
class Settings:
    """Timing knobs (seconds)."""

    period: float = 0.1  # long-run shares do not depend on it; CPU use does (see make bench)
    tree_refresh: float = 5.0  # poll of the GPU nodes while inotify watches the tree
    full_refresh: float = 30.0  # every container's nodes, in case a change was missed
    memory_interval: float = 0.5
    publish_interval: float = 2.0  # snapshot for cgpu-smi and /metrics
    save_interval: float = 5.0  # state file (also written on exit and before a hot update)

    def __post_init__(self) -> None:
        for name in ("period", "tree_refresh", "full_refresh", "memory_interval",
                     "publish_interval", "save_interval"):
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


GpuSample = tuple[dict[str, float], set[str]]  # one GPU's usage and active containers
_NOTHING: GpuSample = ({}, set())
# Gates fail open when the heartbeat is older than the region's gate timeout (2 s).
HEARTBEAT_INTERVAL = 0.25


def split_by_gpu(sample: PlaneSample) -> dict[int, GpuSample]:
    """A plane sample cut into one (usage, active) pair per GPU."""
    per_gpu: dict[int, GpuSample] = {}
    for (gpu, name), used in sample.usage.items():
        per_gpu.setdefault(gpu, ({}, set()))[0][name] = used
    for gpu, name in sample.active:
        per_gpu.setdefault(gpu, ({}, set()))[1].add(name)
    return per_gpu


@dataclass
class GpuState:
    """One GPU's live state: its scheduler and what it decided last."""

    index: int
    scheduler: GateScheduler
    decision: GateDecision | None = None
    ticks: int = 0


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


async def _in_thread(fn: Callable[[], T], limiter: trio.CapacityLimiter) -> T:
    return await trio.to_thread.run_sync(fn, limiter=limiter)


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
        self.tree = tree
        self.plane = plane
        self.state_dir = state_dir
        self.settings = settings or Settings()
        self.notifier = notifier or Notifier({})
        self.wall_clock = wall_clock
        self.restart = restart
        if blocking is None:
            limiter = trio.CapacityLimiter(1)
            blocking = partial(_in_thread, limiter=limiter)
        self._blocking: Blocking[Any] = blocking
        self.view = DaemonView()
        self.gpus: dict[int, GpuState] = {}
        self.fed_meminfo: dict[Key, dict[int, int]] = {}
        self.last_tick = 0.0
        self.upgrading = False
        self._saved_state: dict[str, Any] | None = None
        self._tree_error: str | None = None
        self.watcher: Watcher | None = None
        self.gpu_info = dict(gpu_info or {})
        self.version = ""
        self.publish = publish
        self.started = wall_clock()
        self.last_sample = PlaneSample(usage={}, active=set())
        self.usage_start: dict[Key, float] = {}
        self.utilization: dict[Key, float] = {}
        self._usage_history: collections.deque[tuple[float, dict[Key, float]]] = (
            collections.deque())
        self.memory = ProcessMemory(by_container={})
        self.stopped: dict[Key, int] = {}

    # -- the tree ------------------------------------------------------------

    async def _read_container(self, gpu: int, name: str) -> bool:
        """Read one container's nodes into the view; False when it is gone."""
        try:
            nodes = await self._blocking(partial(self.tree.read_container, gpu, name))
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
            await self._blocking(partial(self.plane.attach, names))
            if self.watcher is not None:
                self.watcher.sync(self.view.nodes)
        self._apply()

    async def _read_all(self) -> None:
        """Every node of the tree (start, SIGHUP, and the slow safety sweep)."""
        quick = await self._blocking(partial(self.tree.read_quick, True))
        self.version = quick.version
        await self._refresh(quick, every_container=True)

    def _apply(self) -> None:
        """Push the view into the GPU schedulers, creating or dropping GPUs."""
        for index in list(self.gpus):
            if index not in self.view.nodes:
                del self.gpus[index]
        for index in self.view.nodes:
            config = self.view.config(index)
            state = self.gpus.get(index)
            if state is None:
                scheduler = GateScheduler(config, period=self.settings.period)
                saved = (self._saved_state or {}).get("gpus", {}).get(str(index))
                if saved:
                    scheduler.restore(saved)
                self.gpus[index] = GpuState(index, scheduler)
            elif state.scheduler.config != config:
                state.scheduler.configure(config)

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
        quick = await self._blocking(self.tree.read_quick)
        await self._refresh(quick)
        if quick.upgrade == 1 and self.restart is not None and not self.upgrading:
            await self._upgrade()

    async def _poll_names(self) -> None:
        names = await self._blocking(self.tree.read_names)
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

    # -- accounting and the schedulers ---------------------------------------

    async def _serve_scheduling(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Every period: measure, step every GPU's scheduler, set the gates that changed."""
        task_status.started()
        deadline = trio.current_time()
        next_beat = deadline
        while True:
            beat = trio.current_time() >= next_beat
            if beat:
                next_beat = trio.current_time() + HEARTBEAT_INTERVAL
            sample = await self._blocking(partial(self._measure, beat))
            now = trio.current_time()  # as close to the measurement as this loop gets
            for key, used in sample.usage.items():
                self.usage_start.setdefault(key, used)
            self.last_sample = sample
            per_gpu = split_by_gpu(sample)
            changed: dict[int, frozenset[str]] = {}
            for index, state in list(self.gpus.items()):
                usage, active = per_gpu.get(index, _NOTHING)
                decision = state.scheduler.step(now, usage, active)
                if state.decision is None or decision.open != state.decision.open:
                    changed[index] = decision.open
                state.decision = decision
                state.ticks += 1
            if changed:
                await self._blocking(partial(self._drive, changed))
            self.last_tick = now
            deadline += self.settings.period
            await trio.sleep_until(deadline)

    def _measure(self, beat: bool) -> PlaneSample:
        """Worker thread: measure, and stamp the heartbeat when it is due."""
        sample = self.plane.sample()
        if beat:
            self.plane.heartbeat()
        return sample

    def _drive(self, changed: Mapping[int, frozenset[str]]) -> None:
        """Worker thread: set the gates of the GPUs whose decision changed."""
        for index, open_ in changed.items():
            self.plane.set_gates(index, open_)

    # -- memory: meminfo feed and backstop -----------------------------------

    async def _serve_memory(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        deadline = trio.current_time()
        while True:
            try:
                memory = await self._blocking(self.plane.memory)
            except OSError as error:
                log.warning("cannot read GPU memory: %s", error)
            else:
                self.memory = memory
                await self._feed_meminfo(memory.by_container)
                await self._backstop(memory.by_container)
            deadline += self.settings.memory_interval
            await trio.sleep_until(deadline)

    async def _feed_meminfo(self, by_container: Mapping[Key, Mapping[int, int]]) -> None:
        for key in list(self.view.specs):  # the tree task may change it while we await
            procs = dict(by_container.get(key, {}))
            if self.fed_meminfo.get(key) == procs:
                continue
            try:
                await self._blocking(partial(self.tree.feed_meminfo, key[0], key[1], procs))
            except OSError as error:
                log.debug("meminfo %s on GPU %d not fed: %s", key[1], key[0], error)
                continue
            self.fed_meminfo[key] = procs
        for key in set(self.fed_meminfo) - set(self.view.specs):
            del self.fed_meminfo[key]

    async def _backstop(self, by_container: Mapping[Key, Mapping[int, int]]) -> None:
        for key, procs in by_container.items():
            limit = self.view.memsize.get(key, 0)
            over = over_limit(procs, limit)
            if over:
                log.warning(
                    "container %s on GPU %d holds %d bytes over its limit of %d: stopping pids %s",
                    key[1], key[0], sum(procs.values()) - limit, limit,
                    " ".join(map(str, over)),
                )
                await self._blocking(partial(self.plane.stop, key[0], key[1], over))
                self.stopped[key] = self.stopped.get(key, 0) + len(over)

    # -- publishing, state, systemd ------------------------------------------

    def state_path(self) -> Path:
        return self.state_dir / STATE_NAME

    def state(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "pid": os.getpid(),
            "saved": self.wall_clock(),
            "gpus": {str(i): s.scheduler.to_state() for i, s in self.gpus.items()},
        }

    def save_state(self) -> None:
        path = self.state_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(self.state(), sort_keys=True))
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

    def _utilization_since(self, now: float) -> dict[Key, float]:
        """Each container's GPU time per second over the last UTILIZATION_WINDOW (0..1)."""
        usage = dict(self.last_sample.usage)
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
        self.utilization = self._utilization_since(now)
        gpus = []
        containers = []
        for index in sorted(self.view.nodes):
            nodes = self.view.nodes[index]
            info = self.gpu_info.get(index)
            total = info.memory_total if info else 0
            decision = self.gpus[index].decision if index in self.gpus else None
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
                procs = self.memory.by_container.get(key, {})
                memsize = self.view.memsize.get(key, 0)
                usage = self.last_sample.usage.get(key, 0.0)
                containers.append(snap.ContainerFigures(
                    name=name, id=self.view.ids.get(key, 0), gpu=index, weight=spec.weight,
                    highprio=spec.highprio, util_limit=spec.util_limit,
                    target_share=float(decision.shares.get(name, 0)) if decision else 0.0,
                    utilization=min(1.0, self.utilization.get(key, 0.0)),
                    memory_used_bytes=sum(procs.values()),
                    memory_limit_bytes=memsize or total,
                    gpu_time_seconds=max(0.0, usage - self.usage_start.get(key, usage)),
                    gate_wait_seconds=self.last_sample.gate_wait.get(key, 0.0),
                    oom_events=self.last_sample.oom_refusals.get(key, 0)
                    + self.stopped.get(key, 0),
                    processes=tuple(snap.ProcessFigures(pid, size)
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
        next_save = trio.current_time() + self.settings.publish_interval  # soon after start
        while True:
            if self.publish is not None:
                try:
                    self.publish(self.snapshot())
                except OSError as error:
                    log.warning("cannot publish the snapshot: %s", error)
            await trio.sleep(self.settings.publish_interval)
            if trio.current_time() >= next_save:
                next_save = trio.current_time() + self.settings.save_interval
                try:
                    self.save_state()
                except OSError as error:
                    log.warning("cannot save state: %s", error)

    async def _serve_watchdog(self, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            # Ping only while the schedulers tick: a stuck daemon gets restarted.
            stalled = self.gpus and trio.current_time() - self.last_tick > max(
                interval * 2, self.settings.period * 10
            )
            if not stalled:
                self.notifier.watchdog()

    def _status(self) -> str:
        return f"{len(self.gpus)} GPUs, {len(self.view.specs)} containers"

    async def _finish_upgrade_if_restarted(self) -> None:
        if os.environ.get(UPGRADED_ENV) != "1":
            return
        os.environ.pop(UPGRADED_ENV, None)
        try:
            await self._blocking(self.tree.finish_upgrade)
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
        self.restart()

    # -- the whole -----------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every service, report READY, and run until cancelled; fail open on the way out."""
        self.load_state()
        self.watcher = self.tree.watcher()
        try:
            async with trio.open_nursery() as services:
                await services.start(self._serve_tree)
                await services.start(self._serve_scheduling)
                await services.start(self._serve_memory)
                await services.start(self._serve_publish)
                interval = watchdog_interval()
                if interval is not None:
                    services.start_soon(self._serve_watchdog, interval)
                self.last_tick = trio.current_time()
                self.notifier.ready(self._status())
                log.info("running: %s, period %.3f s", self._status(), self.settings.period)
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
        try:
            self.plane.open_all()
        except Exception as error:  # the gates must open: log whatever failed
            log.error("opening the gates failed: %s", error)
        with contextlib.suppress(OSError):
            if self.gpus:
                self.save_state()


def over_limit(procs: Mapping[int, int], limit: int) -> list[int]:
    """The processes to stop so that the rest fit in `limit` (largest first); [] if within."""
    if limit <= 0:
        return []
    total = sum(procs.values())
    chosen: list[int] = []
    for pid, size in sorted(procs.items(), key=lambda item: (-item[1], item[0])):
        if total <= limit:
            break
        chosen.append(pid)
        total -= size
    return chosen


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
                        help="scheduling period in seconds (default %(default)s)")
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
    """`--count-gpus` / `--module-params`: what the service units need from NVML."""
    from cgpu_km.gpus import GpuError, discover_gpus

    try:
        found = discover_gpus()
    except GpuError as error:
        print(f"cgpu-daemon: {error}", file=sys.stderr)
        return 1
    if args.count_gpus:
        print(max(1, len(found)))
    else:
        sizes = ",".join(str(g.memory_total) for g in found)
        print(f"gpus={max(1, len(found))}" + (f" gpu_mem={sizes}" if sizes else ""))
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
        settings = Settings(period=args.period, tree_refresh=args.tree_refresh,
                            full_refresh=args.full_refresh)
    except ValueError as error:
        print(f"cgpu-daemon: {error}", file=sys.stderr)
        return 2
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
    plane = make_plane(args.region_dir)
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
