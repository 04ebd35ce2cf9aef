"""The real data plane for the daemon: regions, one dispatcher per GPU, NVML, the kernel's view.

`RegionPlane` implements `cgpu_km.daemon.edges.Plane`:

- regions: `<region dir>/<container>/` (`cgpu_km.dataplane.region`), attached as the
  tree lists the containers (`cgpu_km.dataplane.registry`);
- scheduling: one `cgpu_km.dataplane.dispatch.Dispatcher` thread per GPU over the
  regions of that GPU's containers; GPU time is what the dispatcher charged
  from grants to drain answers, never NVML's utilization;
- memory: NVML's running processes (host pids), put into containers by the
  kernel (`cgpu_km.dataplane.attribution.measure`); processes are stopped only after the
  kernel confirmed who they are;
- slots: those whose process the kernel no longer runs are reclaimed.

Every NVML failure gives "unknown" for that figure, never an exception out
of the daemon's loops (as gpustat does).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Set
from pathlib import Path
from typing import Any

from cgpu_km.dataplane import attribution, kernelview, stopping
from cgpu_km.dataplane import region as region_mod
from cgpu_km.dataplane.dispatch import THREAD_NAME, Dispatcher, Figures, RegionPort
from cgpu_km.dataplane.registry import Registry
from cgpu_km.dataplane.usage import UsageReader, UsageView
from cgpu_km.sched import QUANTUM, GpuConfig
from cgpu_km.tree.views import Key

SERVE_WAIT = 5.0  # seconds a new dispatcher's thread may take to name itself

log = logging.getLogger("cgpu-daemon")


class RegionPlane:
    """Regions, dispatchers, NVML and the kernel's view, behind `daemon_io.Plane`."""

    def __init__(self, directory: Path, nvml: attribution.Nvml | None, *,
                 quantum: float = QUANTUM, proc: str = kernelview.PROC,
                 priority: int = 0) -> None:
        """`priority`: the dispatchers' SCHED_FIFO priority (0: the default policy)."""
        self.registry = Registry(directory)
        self.nvml = nvml
        self.quantum = quantum
        self.priority = priority
        self.attribution = attribution.Attribution(proc)
        # The compute check reads in a worker of its own: an Attribution of its own.
        self._usage = UsageReader(self.registry, nvml, attribution.Attribution(proc)) \
            if nvml is not None else None
        self._ports: dict[int, RegionPort] = {}
        self._dispatchers: dict[int, Dispatcher] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._lock = threading.Lock()

    # -- regions and dispatchers --

    def attach(self, containers: Mapping[int, Set[str]]) -> bool:
        changed = self.registry.attach(containers)
        with self._lock:
            ports = dict(self._ports)
        for gpu, port in ports.items():
            port.set_entries(self.registry.entries_for(gpu))
        return changed

    def missing(self) -> set[str]:
        return self.registry.missing()

    def schedule(self, gpu: int, config: GpuConfig, state: Mapping[str, Any] | None) -> None:
        with self._lock:
            dispatcher = self._dispatchers.get(gpu)
            new = dispatcher is None
            if dispatcher is None:
                port = RegionPort(gpu)
                port.set_entries(self.registry.entries_for(gpu))
                dispatcher = Dispatcher(gpu, port, config, quantum=self.quantum,
                                        priority=self.priority)
                if state:
                    dispatcher.restore(state)
                thread = threading.Thread(target=dispatcher.serve,
                                          name=THREAD_NAME.format(gpu=gpu),
                                          daemon=True)
                self._ports[gpu], self._dispatchers[gpu], self._threads[gpu] = (
                    port, dispatcher, thread)
                thread.start()
        if new:
            # Named and at its priority before anything reports on it (the next
            # snapshot says what it runs under); a thread that never gets the CPU
            # holds nobody up for long.
            dispatcher.serving.wait(SERVE_WAIT)
            return
        dispatcher.configure(config)

    def forget_gpu(self, gpu: int) -> None:
        with self._lock:
            dispatcher = self._dispatchers.pop(gpu, None)
            thread = self._threads.pop(gpu, None)
            self._ports.pop(gpu, None)
        if dispatcher is not None:
            dispatcher.stop()
        if thread is not None:
            thread.join(timeout=5)

    def set_limit(self, key: Key, limit: int) -> None:
        found = self.registry.keys().get(key)
        if found is not None:
            entry, k = found
            if entry.region.limit(k) != limit:
                entry.region.set_limit(k, limit)

    def egpu(self, key: Key) -> bool:
        found = self.registry.keys().get(key)
        return found is not None and found[0].region.mode == "egpu"

    def figures(self) -> dict[int, Figures]:
        with self._lock:
            dispatchers = dict(self._dispatchers)
        return {gpu: d.figures() for gpu, d in dispatchers.items()}

    def scheduler_state(self, gpu: int) -> dict[str, Any]:
        with self._lock:
            dispatcher = self._dispatchers.get(gpu)
        return dispatcher.state() if dispatcher is not None else {}

    def ticking(self, within: float) -> bool:
        with self._lock:
            threads = dict(self._threads)
        figures = self.figures()
        now = time.monotonic()
        return all(threads[g].is_alive() and now - f.last_step <= within
                   for g, f in figures.items())

    def close(self) -> None:
        with self._lock:
            gpus = list(self._dispatchers)
        for gpu in gpus:
            self.forget_gpu(gpu)  # each dispatcher opens its gates on the way out
        for entry in self.registry.all():  # and anything no dispatcher drove
            for k in range(entry.region.ngpus):
                entry.region.set_gate(k, True)

    # -- memory and slots --

    def memory(self) -> attribution.MemoryView:
        """Every container's GPU memory, also published in each region for libcgpu."""
        view = attribution.measure(self.registry, self.nvml, self.attribution)
        if self.nvml is not None:
            for entry in self.registry.all():
                entry.region.publish_seen(view.seen.get(entry.name, ()))
        return view

    def audit(self, key: Key, length: float, why: str) -> None:
        with self._lock:
            dispatcher = self._dispatchers.get(key[0])
        if dispatcher is not None:
            dispatcher.audit(key[1], length, why)

    def usage(self) -> UsageView:
        """NVML's per-process samples since the last call, put in containers, with
        each dispatcher's grants (read after the samples, so that they cover them)."""
        if self._usage is None:
            return UsageView(time.monotonic(), {})
        with self._lock:
            dispatchers = dict(self._dispatchers)
        return self._usage.read(lambda: {gpu: d.grants() for gpu, d in dispatchers.items()})

    def reclaim(self) -> int:
        """Slots of processes the kernel does not run (in the container the slot
        names) are freed: their pending launches and memory leave the container.
        A slot claimed since the round looked was not asked about: it is alive
        until the next round says otherwise."""
        entries = [entry for entry in self.registry.all() if entry.region.live_slots()]
        views = {entry.name: entry.region.processes() for entry in entries}
        slots = {(view.pidns, view.pid, view.start_time)
                 for found in views.values() for view in found}
        if not slots:
            return 0
        running = self.attribution.running(slots)
        host = self.attribution.host
        freed = 0
        for entry in entries:
            owner = entry.owner

            def alive(view: region_mod.ProcView, owner: kernelview.Owner | None = owner) -> bool:
                key = (view.pidns, view.pid, view.start_time)
                if key not in slots:
                    return True  # claimed meanwhile: the next round asks the kernel
                if key not in running:
                    return False
                if owner is None:
                    return True
                info = self.attribution.running_info(self.attribution.host_pid(key))
                return info is not None and kernelview.belongs(info, owner, host,
                                                               self.attribution.proc)

            gone = entry.region.reclaim(alive)
            if gone:
                log.info("container %s: reclaimed the slots of %d exited processes",
                         entry.name, len(gone))
                freed += len(gone)
        return freed

    def target(self, key: Key, pid: int, *, oom_script: bool = True
               ) -> stopping.Target | None:
        """`pid` (a host pid the kernel put in container `key`) pinned by a pidfd
        for a stop, with eGPU's OOM script (with `oom_script`), to be run inside
        the container as the process's user; None when it is not (any more) a
        process of that container."""
        found = self.registry.keys().get(key)
        info = self.attribution.info(pid)
        if found is None or info is None:
            return None
        entry, k = found
        if entry.owner is None or not kernelview.belongs(info, entry.owner,
                                                         self.attribution.host,
                                                         self.attribution.proc):
            return None  # not (any more) a process of that container
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return None
        try:
            again = kernelview.process_info(pid, self.attribution.proc)
            if again is None or again.start_time != info.start_time \
                    or again.state in ("Z", "X"):
                os.close(pidfd)
                return None  # another process got the pid, or it has exited
            script = entry.region.oom_script if oom_script and entry.region.mode == "egpu" \
                else ""
            usage = sum(p.mem[k] for p in entry.region.processes()) if script else 0
            return stopping.Target(pid, pidfd, oom_script=script, owner=entry.owner, env={
                "CGPU_OOM_CONTAINER": entry.name, "CGPU_OOM_GPU": str(k),
                "CGPU_OOM_LIMIT": str(entry.region.limit(k)), "CGPU_OOM_USAGE": str(usage),
                "CGPU_OOM_PID": str(info.inner_pid)})
        except BaseException:
            os.close(pidfd)
            raise


def make_plane(region_dir: str | None, *, quantum: float = QUANTUM,
               priority: int = 0) -> RegionPlane:
    """The plane for this host: regions plus NVML (simgpu without a driver)."""
    directory = Path(region_dir) if region_dir else region_mod.region_dir()
    nvml: attribution.Nvml | None
    try:
        nvml = attribution.Nvml()
    except Exception as error:  # NVML absent or broken: gates still work, memory is unknown
        log.warning("NVML unavailable (%s): no GPU memory figures", error)
        nvml = None
    return RegionPlane(directory, nvml, quantum=quantum, priority=priority)
