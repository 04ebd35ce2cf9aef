"""The region services: attach the regions of new containers, free the
process slots of processes the kernel no longer runs."""

from __future__ import annotations

import logging
from functools import partial

import trio

from cgpu_km.daemon.context import DaemonView, Settings, Ticks, Worker
from cgpu_km.daemon.edges import Plane

log = logging.getLogger("cgpu-daemon")


async def serve_attach(plane: Plane, view: DaemonView, settings: Settings, worker: Worker, *,
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Every period: attach the regions of listed containers that had none
    (the hook and cgpu-run register before they create the region)."""
    task_status.started()
    async for _ in Ticks(settings.period):
        try:
            missing: set[str] = await worker(plane.missing)
            if view.nodes and missing:
                await worker(partial(plane.attach, view.listed()))
        except OSError as error:
            log.warning("cannot attach new regions: %s", error)


async def serve_reclaim(plane: Plane, settings: Settings, worker: Worker, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Every reclaim interval: free the slots of processes that are gone."""
    task_status.started()
    async for _ in Ticks(settings.reclaim_interval):
        try:
            await worker(plane.reclaim)
        except OSError as error:
            log.warning("cannot reclaim process slots: %s", error)
