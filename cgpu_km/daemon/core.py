"""The daemon: its services composed, each its own task with its own worker
thread and its own schedule, so one slow service never holds up another.

- tree (`treesync`): the view of the control tree, pushed into the data
  plane; the regions attached (new containers', and those that were missing);
- scheduling: the data plane runs one dispatcher thread per GPU
  (`dispatch`), which hands the GPU to one container at a time in slices and
  stamps the heartbeat; the daemon only configures them;
- reclaim (`regions`): dead processes' slots freed;
- memory (`memory`): meminfo fed into the tree, the backstop;
- stops (`stops`): every stop of the node, each in a task and a thread of
  its own (OOM scripts in a pool of their own, their processes frozen);
- publishing (`publishing`): the snapshot, the state file;
- lifecycle (`lifecycle`): systemd, signals, the hot update.

Signals: TERM/INT open every gate, save the state and exit 0; HUP reloads.
After a crash or a restart the daemon reattaches to the tree and the regions
as they are and restores the scheduler credits from the state file when it
is recent.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import trio

from cgpu_km.daemon import snapshot as snap
from cgpu_km.daemon.compute import ComputeService
from cgpu_km.daemon.context import Blocking, Limits, Settings, Worker
from cgpu_km.daemon.edges import Plane, Tree
from cgpu_km.daemon.lifecycle import Lifecycle
from cgpu_km.daemon.memory import MemoryService
from cgpu_km.daemon.publishing import Publisher, StateFile
from cgpu_km.daemon.regions import serve_reclaim
from cgpu_km.daemon.sdnotify import Notifier, watchdog_interval
from cgpu_km.daemon.stops import Stops
from cgpu_km.daemon.treesync import TreeSync
from cgpu_km.gpus import GpuInfo

log = logging.getLogger("cgpu-daemon")


class Daemon:
    """The daemon's services; `run` is the whole program minus argv."""

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
        self.settings = settings or Settings()
        self.notifier = notifier or Notifier({})
        self.state_file = StateFile(state_dir, wall_clock)

        def worker(name: str) -> Worker:
            return Worker(name, blocking, deadline=self.settings.call_deadline)

        self.lifecycle = Lifecycle(self.notifier, worker("lifecycle"), restart=restart,
                                   save_state=self._save_state)
        limits_out, limits_in = trio.open_memory_channel[Limits](math.inf)
        self.sync = TreeSync(tree, plane, self.settings, worker("tree"),
                             attach_worker=worker("attach"), limits=limits_out,
                             restored=self.state_file.load(), on_upgrade=self.lifecycle.upgrade)
        # Each stop in a task and a thread of its own, with a deadline of its own.
        self.stops = Stops(plane, self.settings, blocking=blocking)
        self.memory = MemoryService(
            tree, plane, limits_in, self.settings, worker=worker("memory"),
            feed_worker=worker("meminfo"), stops=self.stops)
        self.compute = ComputeService(plane, self.settings, worker=worker("compute"),
                                      stop=partial(self.stops.request, reason="compute",
                                                   oom_script=False))
        self.publisher = Publisher(plane, self.sync, self.memory, self.state_file,
                                   self.settings, worker("publish"), gpu_info=gpu_info or {},
                                   publish=publish,
                                   overuse=self.compute.verdicts)
        self._reclaim_worker = worker("reclaim")

    def _save_state(self) -> None:
        self.publisher.save_state()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every service, report READY, and run until cancelled; fail open on the way out."""
        try:
            async with trio.open_nursery() as services:
                await services.start(self.sync.serve)
                await self.lifecycle.finish_upgrade_if_restarted(self.tree)
                await services.start(serve_reclaim, self.plane, self.settings,
                                     self._reclaim_worker)
                await services.start(self.stops.serve)
                await services.start(self.memory.serve)
                await services.start(self.compute.serve)
                await services.start(self.publisher.serve)
                interval = watchdog_interval()
                if interval is not None:
                    services.start_soon(self.lifecycle.serve_watchdog, self.plane, interval)
                self.notifier.ready(self.sync.status())
                log.info("running: %s, slice %.3f s", self.sync.status(), self.settings.slice)
                task_status.started()
        finally:
            if not self.lifecycle.upgrading:
                self.notifier.stopping()
                self.shutdown()

    async def reload(self) -> None:
        """SIGHUP: re-read the whole tree and reattach the regions."""
        await self.lifecycle.reload(self.sync.reload, self.sync.status)

    def shutdown(self) -> None:
        """Fail open and keep the credits for the next daemon (synchronous, never raises)."""
        state: dict[str, Any] | None = None
        with contextlib.suppress(Exception):
            state = self.state_file.state(self.plane, self.sync.scheduled)
        try:
            self.plane.close()
        except Exception as error:  # the gates must open: log whatever failed
            log.error("opening the gates failed: %s", error)
        with contextlib.suppress(OSError):
            if state is not None and self.sync.scheduled:
                self.state_file.write(state)
