"""The memory service: NVML's processes put into containers by the kernel's
view, fed into the tree (`meminfo`), the backstop that stops the processes
of a container over its limit, and the stop of processes that hold GPU
memory without libcgpu (no GPU time outside the scheduler, policies 0-4).
The stops themselves are the stops service's (`cgpu_km.daemon.stops`): each
round asks again for every process that should be stopped and is still
listed, so a stop that did not see its process go is tried again."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import partial

import trio

from cgpu_km.daemon.backstop import Grandfather, over_limit
from cgpu_km.daemon.context import Limits, Settings, Ticks, Worker
from cgpu_km.daemon.edges import Plane, Tree
from cgpu_km.daemon.stops import Stops
from cgpu_km.dataplane.attribution import MemoryView
from cgpu_km.tree.views import Key

log = logging.getLogger("cgpu-daemon")


class MemoryService:
    """GPU memory by container, every `memory_interval`, and what is done about it."""

    def __init__(self, tree: Tree, plane: Plane, limits: trio.MemoryReceiveChannel[Limits],
                 settings: Settings, *, worker: Worker, feed_worker: Worker,
                 stops: Stops) -> None:
        """`limits`: the tree service's `Limits`, taken at the start of every round."""
        self.tree = tree
        self.plane = plane
        self.limits_in = limits
        self.limits = Limits(memsize={})
        self.settings = settings
        self.worker = worker
        self.feed_worker = feed_worker
        self.stops = stops
        self.memory = MemoryView(by_container={})
        self.grandfather = Grandfather()
        self.round_done = trio.Event()  # set (and replaced) at the end of every round
        # Bypassing processes reported or stopped, while NVML still lists them.
        self._handled: set[tuple[Key, int]] = set()
        self._fed: dict[Key, dict[int, int]] = {}

    @property
    def stopped(self) -> Mapping[Key, int]:
        """Processes stopped for memory, by container."""
        return self.stops.counts("memory")

    @property
    def bypass_stopped(self) -> Mapping[Key, int]:
        """Processes stopped for holding GPU memory without libcgpu, by container."""
        return self.stops.counts("bypass")

    @property
    def stopping(self) -> frozenset[tuple[Key, int]]:
        """The stops under way (of any reason)."""
        return self.stops.under_way()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        task_status.started()
        async for _ in Ticks(self.settings.memory_interval, at_once=True):
            try:
                memory = await self.worker(self.plane.memory)
            except OSError as error:
                log.warning("cannot read GPU memory: %s", error)
                continue
            self.memory = memory
            self._backstop(memory, self._take_limits())
            self._bypass(memory)
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
        """Feed the meminfo that changed since it was last fed, in one worker call
        (a busy node changes a few every round: one thread's round trip, not one
        each); one that could not be fed is tried again next round."""
        listed = self.limits.memsize
        changed = {}
        for key in sorted(listed):
            found = memory.by_container.get(key)
            procs = dict(found.procs) if found is not None else {}
            if self._fed.get(key) != procs:
                changed[key] = procs
        for key in set(self._fed) - set(listed):
            del self._fed[key]
        if not changed:
            return
        try:
            fed = await self.feed_worker(partial(self._feed, changed))
        except OSError as error:  # the worker gave no answer: a wedged tree
            log.debug("meminfo not fed: %s", error)
            return
        self._fed.update((key, changed[key]) for key in fed)

    def _feed(self, changed: Mapping[Key, dict[int, int]]) -> list[Key]:
        """In the feed worker: write each container's meminfo; those written."""
        fed = []
        for (gpu, name), procs in changed.items():
            try:
                self.tree.feed_meminfo(gpu, name, procs)
            except OSError as error:
                log.debug("meminfo %s on GPU %d not fed: %s", name, gpu, error)
                continue
            fed.append((gpu, name))
        return fed

    def _backstop(self, memory: MemoryView, lowered: frozenset[Key]) -> None:
        """Stop the largest processes of every container over its limit (the stops
        service: each stop in a task and a thread of its own). A limit lowered
        below what a cGPU container holds leaves it what it held until its use
        falls under (eGPU: the operator asked for the OOM script and the stop)."""
        holding = {key: found for key, found in memory.by_container.items() if found.procs}
        for key, found in holding.items():  # a container that holds nothing has nothing to stop
            limit = self.limits.memsize.get(key, 0)
            if not self.plane.egpu(key):
                limit = self.grandfather.limit(key, limit, found.total, key in lowered)
            over = [pid for pid in over_limit(found.procs, limit)
                    if not self.stops.in_flight(key, pid)]
            if not over:
                continue
            log.warning("container %s on GPU %d holds %d bytes over its limit of %d: "
                        "stopping pids %s", key[1], key[0], found.total - limit, limit,
                        " ".join(map(str, over)))
            for pid in over:
                self.stops.request(key, pid, reason="memory", oom_script=True)
        self.grandfather.forget(set(holding))  # nor is anything held over for it

    def _bypass(self, memory: MemoryView) -> None:
        """Stop (or report) every process of a container that holds GPU memory
        without a process slot: it bypassed libcgpu, so its work never waits
        for the scheduler. libcgpu claims its slot before it makes a context,
        and `measure` looks for the slot after NVML, so a process that just
        started is never taken for one. Under policy 5 only memory counts. Each
        is logged once; a stop is asked for in every round that lists it (the
        stops service runs one at a time per process)."""
        seen = set()
        for key, found in memory.by_container.items():
            if key[0] not in self.limits.managed:
                continue
            stop = self.settings.stops_bypass(key[1])
            for pid in sorted(found.unmanaged):
                seen.add((key, pid))
                if (key, pid) not in self._handled:
                    log.warning("container %s on GPU %d: pid %d holds GPU memory without "
                                "libcgpu (not scheduled): %s", key[1], key[0], pid,
                                "stopping it" if stop else "reported only")
                    self._handled.add((key, pid))
                if stop:
                    self.stops.request(key, pid, reason="bypass", oom_script=False)
        self._handled &= seen
