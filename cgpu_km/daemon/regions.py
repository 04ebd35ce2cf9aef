"""The reclaim service: free the process slots of processes the kernel no
longer runs. (The regions are attached by the tree service, `treesync`.)"""

from __future__ import annotations

import logging

import trio

from cgpu_km.daemon.context import Settings, Ticks, Worker
from cgpu_km.daemon.edges import Plane

log = logging.getLogger("cgpu-daemon")


async def serve_reclaim(plane: Plane, settings: Settings, worker: Worker, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Every reclaim interval: free the slots of processes that are gone."""
    task_status.started()
    async for _ in Ticks(settings.reclaim_interval):
        try:
            await worker(plane.reclaim)
        except OSError as error:
            log.warning("cannot reclaim process slots: %s", error)
