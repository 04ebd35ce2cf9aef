"""The daemon's lifecycle with systemd: READY, WATCHDOG (only while the
dispatchers step), RELOADING, STOPPING; signals; the hot update.

Writing 1 to `upgrade` saves the state and re-executes the daemon (same pid,
so systemd keeps tracking it); the new process restores the state, writes
`upgrade` 0 and carries on.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from cgpu_km.daemon.context import Ticks, Worker
from cgpu_km.daemon.edges import Plane, Tree
from cgpu_km.daemon.sdnotify import Notifier, watchdog_interval

log = logging.getLogger("cgpu-daemon")

UPGRADED_ENV = "CGPU_DAEMON_UPGRADED"


class Lifecycle:
    """What the daemon tells systemd, and the hot update."""

    def __init__(self, notifier: Notifier, worker: Worker, *,
                 restart: Callable[[], None] | None, save_state: Callable[[], None]) -> None:
        self.notifier = notifier
        self.worker = worker
        self.restart = restart
        self.save_state = save_state
        self.upgrading = False

    async def serve_watchdog(self, plane: Plane, interval: float) -> None:
        async for _ in Ticks(interval):
            # Ping only while the dispatchers step: a stuck daemon gets restarted.
            if plane.ticking(within=max(interval * 2, 2.0)):
                self.notifier.watchdog()

    async def finish_upgrade_if_restarted(self, tree: Tree) -> None:
        """After a hot update's re-execution: write 0 to `upgrade`."""
        if os.environ.pop(UPGRADED_ENV, None) != "1":
            return
        # systemd's watchdog timer ran on through the exec (same PID, no new start):
        # ping now, not one interval from now, or the exec's time makes it fire.
        if watchdog_interval() is not None:
            self.notifier.watchdog()
        try:
            await self.worker(tree.finish_upgrade)
            log.info("hot update done")
        except OSError as error:
            log.error("cannot write 0 to upgrade: %s", error)

    async def upgrade(self) -> None:
        """`upgrade` reads 1: save everything and re-execute (the caller's `restart`)."""
        if self.restart is None or self.upgrading:
            return
        self.upgrading = True
        log.info("hot update requested: re-executing with state kept")
        self.notifier.reloading(time.monotonic_ns() // 1000)
        self.save_state()
        os.environ[UPGRADED_ENV] = "1"
        if watchdog_interval() is not None:
            self.notifier.watchdog()  # the exec's time starts from a fresh ping
        self.restart()

    async def reload(self, read_all: Callable[[], Awaitable[None]], status: Callable[[], str]
                     ) -> None:
        """SIGHUP: RELOADING, re-read, READY."""
        self.notifier.reloading(time.monotonic_ns() // 1000)
        await read_all()
        self.notifier.ready(status())


class Runnable(Protocol):
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None: ...

    async def reload(self) -> None: ...


async def run_with_signals(daemon: Runnable) -> None:
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
