"""The tree service: keeps the daemon's view equal to the control tree and
pushes it into the data plane.

inotify says which nodes were written, so `echo 2 > <root>/0/policy` acts
within one period; a slow poll (`tree_refresh`, `full_refresh`) is the safety
net, and without inotify the GPU nodes are polled every period. The regions
are attached here and nowhere else: a new container's when the tree lists it,
and, every period while some are missing, those of listed containers that
had none (the hook and cgpu-run register before they create the region); a
`memsize` written in the tree goes into the container's region at once (live
memory limits).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import trio

from cgpu_km.daemon.context import DaemonView, KnownContainer, Limits, Settings, Ticks, Worker
from cgpu_km.daemon.edges import Plane, Tree, Watcher
from cgpu_km.sched import ContainerSpec, Policy
from cgpu_km.tree.views import LOST, ContainerNodes, Key, QuickView

log = logging.getLogger("cgpu-daemon")


class TreeSync:
    """The view of the tree, kept current, and what the data plane was told of it."""

    def __init__(self, tree: Tree, plane: Plane, settings: Settings, worker: Worker, *,
                 attach_worker: Worker, limits: trio.MemorySendChannel[Limits],
                 restored: Mapping[str, Any] | None = None,
                 on_upgrade: Callable[[], Awaitable[None]] | None = None) -> None:
        """`restored`: the previous daemon's scheduler state by GPU, which each
        GPU's dispatcher starts from when it is first scheduled. `attach_worker`
        looks for missing regions, so a slow region folder never holds up the
        tree. `limits` gets a
        `Limits` whenever the memory limits or the managed GPUs change; it must
        never block (an unbounded channel: changes are rare, and a memory
        service stuck on NVML must not hold up the tree)."""
        self.tree = tree
        self.plane = plane
        self.settings = settings
        self.worker = worker
        self.attach_worker = attach_worker
        self.on_upgrade = on_upgrade
        self.view = DaemonView()
        self.version = ""
        self.watcher: Watcher | None = None
        self.scheduled: set[int] = set()  # GPUs whose dispatcher was configured
        # Set when an attach left a listed container without its region (or its
        # identity): `_serve_missing` looks every period until none is missing.
        self._missing = trio.Event()
        self.limits: dict[Key, int] = {}  # memsize as last given to the regions
        self.restored: Mapping[str, Any] = restored or {}
        self._limits_out = limits
        self._sent = Limits(memsize={})
        self._error: str | None = None
        self._unreadable = trio.Event()  # set by a failed read: the poller reads again

    async def read_all(self) -> None:
        """Every node of the tree (start, SIGHUP, and the slow safety sweep)."""
        quick = await self.worker(partial(self.tree.read_quick, True))
        self.version = quick.version
        await self._refresh(quick, every_container=True)

    async def reload(self) -> None:
        """SIGHUP: re-read the whole tree and reattach the regions."""
        try:
            await self.read_all()
            log.info("reloaded: %s", self.status())
        except OSError as error:
            self._note_error(error)

    def status(self) -> str:
        return f"{len(self.view.nodes)} GPUs, {len(self.view.containers)} containers"

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """Read the tree (started once read), then follow it: watched changes at
        once, a poll of the GPU nodes every `tree_refresh` and of every container's
        nodes every `full_refresh`; without a watcher, every period and every
        `tree_refresh`."""
        self.watcher = self.tree.watcher()
        try:
            await self._first_read()
            async with trio.open_nursery() as nursery:
                if self.watcher is not None:
                    nursery.start_soon(self._serve_watch, self.watcher)
                nursery.start_soon(self._serve_missing)
                task_status.started()
                await self._serve_polls()
        finally:
            if self.watcher is not None:
                self.watcher.close()
                self.watcher = None

    async def _first_read(self) -> None:
        async for _ in Ticks(self.settings.period, at_once=True):
            try:
                await self.read_all()
                break
            except OSError as error:
                self._note_error(error)
        self._note_ok()

    async def _serve_polls(self) -> None:
        watching = self.watcher is not None
        poll = self.settings.tree_refresh if watching else self.settings.period
        full = self.settings.full_refresh if watching else self.settings.tree_refresh
        next_full = trio.current_time() + full
        next_poll = trio.current_time() + poll
        while True:
            with trio.move_on_at(next_poll):
                await self._unreadable.wait()
            if self._unreadable.is_set():  # a read failed, here or in the watch
                await self._until_readable()
                next_full = trio.current_time() + full
                next_poll = trio.current_time() + poll
                continue
            next_poll += poll
            try:
                if trio.current_time() >= next_full:
                    next_full += full
                    await self.read_all()
                else:
                    await self._poll()
                self._note_ok()
            except OSError as error:
                self._note_error(error)

    async def _until_readable(self) -> None:
        """The tree could not be read (cgpu-fuse restarting, say): read all of it
        every period until it can be, which also watches it anew (a remounted
        tree's watches went with the old mount, and it lists its containers again
        within seconds: a container unknown for the gate timeout fails open)."""
        async for _ in Ticks(self.settings.period):
            self._unreadable = trio.Event()
            try:
                await self.read_all()
            except OSError as error:
                self._note_error(error)
                continue
            self._note_ok()
            return

    async def _read_containers(self, keys: Sequence[Key]) -> None:
        """Read these containers' nodes into the view (those gone are left out), in
        one worker call: the safety sweep of 200 containers is one thread's round
        trip, not 200."""
        def read() -> dict[Key, ContainerNodes]:
            found = {}
            for gpu, name in keys:
                try:
                    found[gpu, name] = self.tree.read_container(gpu, name)
                except FileNotFoundError:
                    continue
            return found

        if not keys:
            return
        for key, nodes in (await self.worker(read)).items():
            self.view.containers[key] = KnownContainer(
                id=nodes.id, memsize=nodes.memsize, spec=ContainerSpec(
                    weight=nodes.weight, highprio=bool(nodes.highprio),
                    util_limit=nodes.util_limit))

    async def _refresh(self, quick: QuickView, *, every_container: bool = False) -> None:
        """Merge a quick read: read the containers that appeared (or all of them),
        forget those that left, reattach the regions, apply."""
        old = self.view.nodes
        self.view.nodes = dict(quick.gpus)
        came_or_went = set(old) != set(quick.gpus) or any(
            old[g].containers != quick.gpus[g].containers for g in quick.gpus
        )
        to_read: list[Key] = []
        for gpu, nodes in quick.gpus.items():
            known = old[gpu].containers if gpu in old and not every_container else frozenset()
            to_read += [(gpu, name) for name in sorted(nodes.containers - known)]
        await self._read_containers(to_read)
        present = {(g, n) for g, nodes in quick.gpus.items() for n in nodes.containers}
        self.view.keep(present)
        if came_or_went or every_container:
            await self._attach(self.worker)
            if self.watcher is not None:
                self.watcher.sync(self.view.nodes)
        self._apply()

    async def _attach(self, worker: Worker) -> None:
        """The regions of the containers the tree lists attached, the others' let go."""
        await worker(partial(self.plane.attach, self.view.listed()))
        if self.plane.missing():
            self._missing.set()

    async def _serve_missing(self) -> None:
        """While a listed container has no region, or its region no identity yet:
        every period, attach again. Asleep while none is missing (the look is at
        the registry, in this thread)."""
        while True:
            await self._missing.wait()
            self._missing = trio.Event()
            async for _ in Ticks(self.settings.period):
                try:
                    if not self.plane.missing():
                        break
                    await self._attach(self.attach_worker)
                except OSError as error:
                    log.warning("cannot attach new regions: %s", error)

    def _apply(self) -> None:
        """Push the view into the data plane: each GPU's configuration to its
        dispatcher (started on first use), each container's memsize to its region."""
        for index in self.scheduled - set(self.view.nodes):
            self.plane.forget_gpu(index)
        self.scheduled &= set(self.view.nodes)
        for index in self.view.nodes:
            state = self.restored.get(str(index)) if index not in self.scheduled else None
            self.plane.schedule(index, self.view.config(index), state)
            self.scheduled.add(index)
        lowered = set()
        limits = self.view.memsize()
        for key, memsize in limits.items():
            before = self.limits.get(key)
            if before != memsize:
                if before is not None and (before == 0 or 0 < memsize < before):
                    lowered.add(key)
                self.plane.set_limit(key, memsize)
                self.limits[key] = memsize
        for key in set(self.limits) - set(limits):
            del self.limits[key]
        self._send_limits(frozenset(lowered))

    def _send_limits(self, lowered: frozenset[Key]) -> None:
        managed = frozenset(g for g, nodes in self.view.nodes.items()
                            if nodes.policy != Policy.NATIVE)
        if lowered or managed != self._sent.managed or self.limits != self._sent.memsize:
            self._sent = Limits(memsize=dict(self.limits), managed=managed, lowered=lowered)
            self._limits_out.send_nowait(self._sent)

    async def _poll(self) -> None:
        quick = await self.worker(self.tree.read_quick)
        await self._refresh(quick)
        if quick.upgrade == 1 and self.on_upgrade is not None:
            await self.on_upgrade()

    async def _poll_names(self) -> None:
        names = await self.worker(self.tree.read_names)
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
                if LOST in changes:  # events were lost: any node may have been written
                    await self.read_all()  # (which watches anew)
                    continue
                if any(c.name is None and c.node != "inst_ctl" for c in changes):
                    await self._poll()  # a GPU node or upgrade: rare, read them all
                elif any(c.node == "inst_ctl" for c in changes):
                    # Containers may have come or gone; most often it is only our
                    # own meminfo feed, so list the names, nothing more.
                    await self._poll_names()
                changed = {(c.gpu, c.name) for c in changes
                           if c.gpu is not None and c.name is not None}
                await self._read_containers([key for key in sorted(changed)
                                             if key in self.view.containers])
                if changed:
                    self._apply()
                watcher.sync(self.view.nodes)  # re-watch replaced files (cheap otherwise)
            except OSError as error:
                self._note_error(error)

    def _note_error(self, error: OSError) -> None:
        self._unreadable.set()
        message = f"cannot read the control tree: {error}"
        if message != self._error:
            log.error("%s", message)
            self._error = message

    def _note_ok(self) -> None:
        if self._error is not None:
            log.info("control tree readable again")
            self._error = None
