"""The compute check: every memory interval, the GPU time each container's
processes used as the driver saw it (NVML's per-process samples), weighed
against the spans in which the scheduler let the container run
(`cgpu_km.sched.overuse`). A process whose use was not granted (it stepped
around libcgpu's gate while keeping libcgpu loaded) is stopped, or only
reported, as a process that bypasses libcgpu is (`Settings.stops_bypass`).
Under policy 5 nothing is granted, and nothing is checked."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from cgpu_km.daemon.context import Settings, Ticks, Worker
from cgpu_km.daemon.edges import Plane
from cgpu_km.sched.overuse import Judge, Verdict
from cgpu_km.tree.views import Key

log = logging.getLogger("cgpu-daemon")

# Asks for a stop of (container, host pid); False when one is already under way.
StopRequest = Callable[[Key, int], bool]


class ComputeService:
    """Reads the samples, judges them, stops (or reports) what was not granted."""

    def __init__(self, plane: Plane, settings: Settings, *, worker: Worker,
                 stop: StopRequest) -> None:
        """`stop`: asks for a stop (`cgpu_km.daemon.stops.Stops.request`)."""
        self.plane = plane
        self.settings = settings
        self.worker = worker
        self.stop = stop
        self.judge = Judge(window=settings.compute_window,
                           tolerance=settings.compute_tolerance,
                           audit_every=settings.audit_every)
        self.verdicts: dict[Key, int] = {}  # processes judged, stopped or reported
        self.last: dict[Key, Verdict] = {}  # each container's latest verdict
        self.rounds = 0

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        task_status.started()
        async for _ in Ticks(self.settings.compute_interval):
            try:
                view = await self.worker(self.plane.usage)
            except OSError as error:
                log.warning("cannot read GPU time by process: %s", error)
                continue
            for gpu, found in sorted(view.gpus.items()):
                period = self.judge.periods(gpu)[1]
                self.judge.add(gpu, found.samples)
                if self.judge.periods(gpu)[1] < period:
                    log.info("GPU %d: NVML's per-process samples come %.3f s apart, or a "
                             "multiple of it", gpu, self.judge.periods(gpu)[1])
                for verdict in self.judge.judge(gpu, view.now, found.grants,
                                                found.launched_at, found.hijacked):
                    self._act(verdict)
                for key, why in self.judge.audits_wanted(gpu).items():
                    self.plane.audit(key, self.judge.audit_length(gpu), why)
            self.rounds += 1

    def _act(self, verdict: Verdict) -> None:
        key = verdict.key
        stop = self.settings.stops_bypass(key[1])
        self.last[key] = verdict
        for pid in verdict.pids:
            log.warning("container %s on GPU %d %s: pid %d %s", key[1], key[0],
                        verdict.describe(), pid,
                        "stopping it" if stop else "reported only")
            self.verdicts[key] = self.verdicts.get(key, 0) + 1
            if stop:
                self.stop(key, pid)
