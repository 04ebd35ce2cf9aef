"""The publishing service: the snapshot for `cgpu-smi` and Prometheus, and the
state file that carries the scheduler's credits across restarts."""

from __future__ import annotations

import collections
import json
import logging
import os
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import trio

from cgpu_km.daemon import snapshot as snap
from cgpu_km.daemon.context import Settings, Ticks, Worker
from cgpu_km.daemon.edges import Plane
from cgpu_km.daemon.memory import MemoryService
from cgpu_km.daemon.treesync import TreeSync
from cgpu_km.dataplane.dispatch import Figures
from cgpu_km.fileio import replace_file
from cgpu_km.gpus import GpuInfo
from cgpu_km.tree.model import free_weight
from cgpu_km.tree.views import Key

log = logging.getLogger("cgpu-daemon")

STATE_FORMAT = 1
STATE_NAME = "daemon-state.json"
# Scheduler credits older than this are not restored (the world moved on).
STATE_MAX_AGE = 60.0
# Achieved utilization in the snapshot: GPU time per second over this many seconds.
UTILIZATION_WINDOW = 5.0


class StateFile:
    """`<state_dir>/daemon-state.json`: each GPU's scheduler state, written atomically."""

    def __init__(self, state_dir: Path, wall_clock: Callable[[], float]) -> None:
        self.path = state_dir / STATE_NAME
        self.wall_clock = wall_clock

    def state(self, plane: Plane, gpus: set[int]) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "pid": os.getpid(),
            "saved": self.wall_clock(),
            "gpus": {str(i): plane.scheduler_state(i) for i in sorted(gpus)},
        }

    def write(self, state: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(self.path, json.dumps(state, sort_keys=True), 0o600)

    def load(self) -> dict[str, Any]:
        """The previous daemon's scheduler state by GPU, if its file is recent and sound."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            log.warning("ignoring state file %s: %s", self.path, error)
            return {}
        if (not isinstance(data, dict) or data.get("format") != STATE_FORMAT
                or not isinstance(data.get("gpus"), dict)):
            log.warning("ignoring state file %s: unknown format", self.path)
            return {}
        try:
            age = self.wall_clock() - float(data.get("saved", 0))
        except (TypeError, ValueError):
            age = -1.0
        if not 0 <= age <= STATE_MAX_AGE:
            log.info("state file is %.0f s old: starting with fresh credits", age)
            return {}
        log.info("restored scheduler state saved %.1f s ago", age)
        gpus: dict[str, Any] = data["gpus"]
        return gpus


class Publisher:
    """Freezes the daemon's figures into a snapshot every `publish_interval` and
    saves the state file every `save_interval`."""

    def __init__(self, plane: Plane, sync: TreeSync, memory: MemoryService,
                 state_file: StateFile, settings: Settings, worker: Worker, *,
                 gpu_info: Mapping[int, GpuInfo],
                 publish: Callable[[snap.Snapshot], None] | None,
                 overuse: Mapping[Key, int] | None = None) -> None:
        """`overuse`: the compute check's processes judged, by container (live)."""
        self.plane = plane
        self.overuse = overuse if overuse is not None else {}
        self.sync = sync
        self.memory = memory
        self.state_file = state_file
        self.settings = settings
        self.worker = worker
        self.gpu_info = dict(gpu_info)
        self.publish = publish
        self.started = state_file.wall_clock()
        self.utilization: dict[Key, float] = {}
        self._usage_history: collections.deque[tuple[float, dict[Key, float]]] = (
            collections.deque())

    def save_state(self) -> None:
        self.state_file.write(self.state_file.state(self.plane, self.sync.scheduled))

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        task_status.started()
        next_save = trio.current_time() + self.settings.publish_interval  # soon after start
        async for _ in Ticks(self.settings.publish_interval, at_once=True):
            if self.publish is not None:
                try:
                    await self.worker(partial(self.publish, self.snapshot()))
                except OSError as error:
                    log.warning("cannot publish the snapshot: %s", error)
            if trio.current_time() >= next_save:
                next_save += self.settings.save_interval
                try:
                    await self.worker(self.save_state)
                except OSError as error:
                    log.warning("cannot save state: %s", error)

    @staticmethod
    def _gpu_time(figures: Mapping[int, Figures]) -> dict[Key, float]:
        """GPU seconds each container was charged by its GPU's dispatcher."""
        return {(gpu, name): used for gpu, figure in figures.items()
                for name, used in figure.used.items()}

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
        now = self.state_file.wall_clock()
        figures = self.plane.figures()  # once: every figure below is of one instant
        usage = self._gpu_time(figures)
        self.utilization = self._utilization_since(now, usage)
        view = self.sync.view
        memory = self.memory.memory
        gpus = []
        containers = []
        for index in sorted(view.nodes):
            nodes = view.nodes[index]
            info = self.gpu_info.get(index)
            total = info.memory_total if info else 0
            shares = figures[index].shares if index in figures else {}
            dispatched = figures.get(index)
            gpus.append(snap.GpuFigures(
                index=index, uuid=info.uuid if info else "", name=info.name if info else "",
                memory_total_bytes=total, memory_used_bytes=memory.used_by_gpu.get(index),
                utilization=min(1.0, sum(self.utilization.get((index, n), 0.0)
                                         for n in nodes.containers)),
                policy=nodes.policy, max_inst=nodes.max_inst, prio_ratio=nodes.prio_ratio,
                free_weight=free_weight(nodes.max_inst, (
                    view.containers[index, n].spec.weight for n in nodes.containers
                    if (index, n) in view.containers)),
                dispatch_wakes=dispatched.wakes if dispatched else 0,
                dispatch_steps=dispatched.steps if dispatched else 0,
                switches=dispatched.switches if dispatched else 0,
                dispatch_late_wakes=dispatched.late[0] if dispatched else 0,
                dispatch_late_seconds=dispatched.late[1] if dispatched else 0.0,
                dispatch_late_max_seconds=dispatched.late[2] if dispatched else 0.0,
                dispatch_scheduling=dispatched.scheduling if dispatched else "",
                dispatch_moves=tuple(snap.RowMoves(row, count) for row, count
                                     in sorted(dispatched.moves.items())) if dispatched else (),
            ))
            for name in sorted(nodes.containers):
                key = (index, name)
                listed = view.containers.get(key)
                if listed is None:
                    continue
                spec = listed.spec
                found = memory.by_container.get(key)
                procs = found.procs if found is not None else {}
                unmanaged = found.unmanaged if found is not None else frozenset()
                containers.append(snap.ContainerFigures(
                    name=name, id=listed.id, gpu=index, weight=spec.weight,
                    highprio=spec.highprio, util_limit=spec.util_limit,
                    target_share=float(shares.get(name, 0)),
                    utilization=min(1.0, self.utilization.get(key, 0.0)),
                    memory_used_bytes=sum(procs.values()),
                    memory_limit_bytes=listed.memsize or total,
                    gpu_time_seconds=usage.get(key, 0.0),
                    gate_wait_seconds=memory.gate_wait.get(key, 0.0),
                    oom_events=memory.oom_refusals.get(key, 0) + self.memory.stopped.get(key, 0),
                    processes=tuple(snap.ProcessFigures(pid, size, pid not in unmanaged)
                                    for pid, size in sorted(procs.items())),
                    bypass_stops=self.memory.bypass_stopped.get(key, 0),
                    overuse_stops=self.overuse.get(key, 0),
                    audits=figures[index].audits.get(name, 0) if index in figures else 0,
                ))
        return snap.Snapshot(
            version=self.sync.version, pid=os.getpid(), period_seconds=self.settings.period,
            timestamp=now, started=self.started,
            gpus=tuple(gpus), containers=tuple(containers),
        )
