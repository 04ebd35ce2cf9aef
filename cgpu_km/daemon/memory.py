"""The memory service: NVML's processes put into containers by the kernel's
view, fed into the tree (`meminfo`), the backstop that stops the processes
of a container over its limit, and the stop of processes that hold GPU
memory without libcgpu (no GPU time outside the scheduler, policies 0-4);
each stop a task of its own with a deadline."""

from __future__ import annotations

import logging
from functools import partial

import trio

from cgpu_km.daemon.backstop import Grandfather, over_limit
from cgpu_km.daemon.context import Limits, Settings, Ticks, Worker
from cgpu_km.daemon.edges import Plane, Tree
from cgpu_km.dataplane.attribution import MemoryView
from cgpu_km.tree.views import Key

log = logging.getLogger("cgpu-daemon")


class MemoryService:
    """GPU memory by container, every `memory_interval`, and what is done about it."""

    def __init__(self, tree: Tree, plane: Plane, limits: trio.MemoryReceiveChannel[Limits],
                 settings: Settings, *, worker: Worker, feed_worker: Worker,
                 stop_workers: Worker) -> None:
        """`limits`: the tree service's `Limits`, taken at the start of every round."""
        self.tree = tree
        self.plane = plane
        self.limits_in = limits
        self.limits = Limits(memsize={})
        self.settings = settings
        self.worker = worker
        self.feed_worker = feed_worker
        self.stop_workers = stop_workers
        self.memory = MemoryView(by_container={})
        self.grandfather = Grandfather()
        self.stopping: set[tuple[Key, int]] = set()
        self.stopped: dict[Key, int] = {}  # processes stopped for memory, by container
        self.bypass_stopped: dict[Key, int] = {}  # processes stopped for bypassing libcgpu
        self.round_done = trio.Event()  # set (and replaced) at the end of every round
        # Bypassing processes reported or stopped, while NVML still lists them.
        self._handled: set[tuple[Key, int]] = set()
        self._fed: dict[Key, dict[int, int]] = {}

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        async with trio.open_nursery() as stops:
            task_status.started()
            async for _ in Ticks(self.settings.memory_interval, at_once=True):
                try:
                    memory = await self.worker(self.plane.memory)
                except OSError as error:
                    log.warning("cannot read GPU memory: %s", error)
                    continue
                self.memory = memory
                self._backstop(memory, stops, self._take_limits())
                self._bypass(memory, stops)
                await self._feed_meminfo(memory)
                self.round_done.set()
                self.round_done = trio.Event()

    def _take_limits(self) -> frozenset[Key]:
        """The latest `Limits` the tree service sent; the limits lowered since the last call."""
        lowered: set[Key] = set()
        while True:
            try:
                self.limits = self.limits_in.receive_nowait()
            except trio.WouldBlock:
                return frozenset(lowered)
            lowered |= self.limits.lowered

    async def _feed_meminfo(self, memory: MemoryView) -> None:
        listed = self.limits.memsize
        for key in sorted(listed):
            found = memory.by_container.get(key)
            procs = dict(found.procs) if found is not None else {}
            if self._fed.get(key) == procs:
                continue
            try:
                await self.feed_worker(partial(self.tree.feed_meminfo, key[0], key[1], procs))
            except OSError as error:
                log.debug("meminfo %s on GPU %d not fed: %s", key[1], key[0], error)
                continue
            self._fed[key] = procs
        for key in set(self._fed) - set(listed):
            del self._fed[key]

    def _backstop(self, memory: MemoryView, stops: trio.Nursery, lowered: frozenset[Key]
                  ) -> None:
        """Stop the largest processes of every container over its limit, each in a
        task of its own. A limit lowered below what a cGPU container holds leaves
        it what it held until its use falls under (eGPU: the operator asked for
        the OOM script and the stop)."""
        holding = {key: found for key, found in memory.by_container.items() if found.procs}
        for key, found in holding.items():  # a container that holds nothing has nothing to stop
            limit = self.limits.memsize.get(key, 0)
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
        self.grandfather.forget(set(holding))  # nor is anything held over for it

    def _bypass(self, memory: MemoryView, stops: trio.Nursery) -> None:
        """Stop (or report) every process of a container that holds GPU memory
        without a process slot: it bypassed libcgpu, so its work never waits
        for the scheduler. libcgpu claims its slot before it makes a context,
        and `measure` looks for the slot after NVML, so a process that just
        started is never taken for one. Under policy 5 only memory counts."""
        seen = set()
        for key, found in memory.by_container.items():
            if key[0] not in self.limits.managed:
                continue
            stop = self.settings.stops_bypass(key[1])
            for pid in sorted(found.unmanaged):
                seen.add((key, pid))
                if (key, pid) in self.stopping or (key, pid) in self._handled:
                    continue
                log.warning("container %s on GPU %d: pid %d holds GPU memory without "
                            "libcgpu (not scheduled): %s", key[1], key[0], pid,
                            "stopping it" if stop else "reported only")
                self._handled.add((key, pid))
                if stop:
                    self.stopping.add((key, pid))
                    stops.start_soon(self._stop, key, pid, True)
        self._handled &= seen

    async def _stop(self, key: Key, pid: int, bypass: bool = False) -> None:
        try:
            with trio.move_on_after(self.settings.stop_deadline) as scope:
                await self.stop_workers(partial(self.plane.stop, key, pid,
                                                oom_script=not bypass))
            if scope.cancelled_caught:
                log.warning("stopping pid %d of %s took over %.0f s", pid, key[1],
                            self.settings.stop_deadline)
            counts = self.bypass_stopped if bypass else self.stopped
            counts[key] = counts.get(key, 0) + 1
        finally:
            self.stopping.discard((key, pid))
