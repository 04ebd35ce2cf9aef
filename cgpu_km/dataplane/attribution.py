"""GPU memory as the driver and the kernel see it, by container.

The daemon's memory service reads every GPU process from NVML (host pids),
asks the kernel which container each belongs to (`kernelview.belongs`
against the identity recorded at registration, never a pid a container
wrote), and so knows each container's real GPU memory, including processes
that bypassed libcgpu (no process slot: "unmanaged"). Those figures feed
`meminfo`, `cgpu-smi`, the metrics and the backstop
(`cgpu_km.daemon.backstop`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from typing import Any

from cgpu_km.dataplane import kernelview
from cgpu_km.dataplane import region as region_mod
from cgpu_km.dataplane.registry import Registry
from cgpu_km.tree.views import Key

log = logging.getLogger("cgpu-daemon")


class Nvml:
    """The NVML reads the daemon needs, with failures turned into empty answers."""

    def __init__(self) -> None:
        import pynvml

        self.nvml: Any = pynvml
        self.nvml.nvmlInit()
        self.handles: dict[int, Any] = {}
        for position in range(int(self.nvml.nvmlDeviceGetCount())):
            handle = self.nvml.nvmlDeviceGetHandleByIndex(position)
            self.handles[int(self.nvml.nvmlDeviceGetIndex(handle))] = handle

    def memory_by_pid(self) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
        """Bytes per (gpu, host pid) of the running compute processes, and used per GPU.

        Every row counts: the sum of a pid's rows on a GPU. NVML may list one
        process several times on one GPU, a row per context with that
        context's memory (NVIDIA's driver does in some versions; simgpu does
        for a process that loaded a second copy of libcuda, which has its own
        contexts). Keeping one row would hide the others: a process that
        allocated 3 GiB through a copy of libcuda opened with RTLD_DEEPBIND
        and 64 MiB through libcgpu was held at 64 MiB. Were a driver to repeat
        a process's whole figure in each row, the sum would overcount it: a
        process stopped too soon, never one let over its limit."""
        procs: dict[tuple[int, int], int] = {}
        used: dict[int, int] = {}
        for gpu, handle in self.handles.items():
            with contextlib.suppress(self.nvml.NVMLError):
                for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    size = proc.usedGpuMemory
                    key = gpu, int(proc.pid)
                    procs[key] = procs.get(key, 0) + (int(size) if size is not None else 0)
            with contextlib.suppress(self.nvml.NVMLError):
                used[gpu] = int(self.nvml.nvmlDeviceGetMemoryInfo(handle).used)
        return procs, used

    def utilization_by_pid(self, last_seen: Mapping[int, int]
                           ) -> dict[int, list[tuple[int, int, int]]]:
        """NVML's sampled per-process utilization (for display only): per GPU,
        (host pid, timestamp in us, percent) newer than `last_seen[gpu]`."""
        found: dict[int, list[tuple[int, int, int]]] = {}
        for gpu, handle in self.handles.items():
            try:
                samples = self.nvml.nvmlDeviceGetProcessUtilization(handle, last_seen.get(gpu, 0))
            except self.nvml.NVMLError:
                continue
            found[gpu] = [(int(s.pid), int(s.timeStamp), int(s.smUtil)) for s in samples]
        return found


@dataclass(frozen=True)
class ContainerMemory:
    """One container's GPU memory on one GPU, by host pid, from NVML."""

    procs: Mapping[int, int] = field(default_factory=dict)
    unmanaged: frozenset[int] = frozenset()  # host pids with no live process slot

    @property
    def total(self) -> int:
        return sum(self.procs.values())


@dataclass(frozen=True)
class MemoryView:
    """What the memory service measured at one instant. A container that has
    neither a live slot nor a process in NVML is in none of the maps."""

    by_container: Mapping[Key, ContainerMemory]
    used_by_gpu: Mapping[int, int] = field(default_factory=dict)
    stray: Mapping[int, Mapping[int, int]] = field(default_factory=dict)  # gpu -> pid -> bytes
    # As the containers' processes report them (display only): cumulative
    # seconds their launches waited at the gate, allocations refused.
    gate_wait: Mapping[Key, float] = field(default_factory=dict)
    oom_refusals: Mapping[Key, int] = field(default_factory=dict)
    # Per container (region) name: its processes as the kernel and NVML saw
    # them, published in its region's control part for libcgpu.
    seen: Mapping[str, tuple[region_mod.Seen, ...]] = field(default_factory=dict)


class Attribution:
    """Which container the kernel puts each GPU process in (cached per pid and start)."""

    def __init__(self, proc: str = kernelview.PROC) -> None:
        self.proc = proc
        self.host = kernelview.Host.read(proc)
        self._info: dict[int, kernelview.ProcessInfo | None] = {}
        self._host_pids: dict[tuple[int, int, int], int] = {}
        self._running: dict[int, kernelview.ProcessInfo] = {}  # read by the last `running`
        self._known: dict[tuple[int, int, int], kernelview.ProcessInfo] = {}

    def info(self, pid: int) -> kernelview.ProcessInfo | None:
        """What the kernel says of host pid `pid` now (None: gone)."""
        fresh = kernelview.process_info(pid, self.proc)
        if len(self._info) > 4096:
            self._info.clear()
        self._info[pid] = fresh
        return fresh

    def known_info(self, pid: int) -> kernelview.ProcessInfo | None:
        """`info` as it was first read, while the stat of `pid` shows that process
        still running (a host pid and a start time name one process, whose pid
        namespace and pid in it never change, and its cgroups only within
        what the container may move it in): the memory round looks at the same
        processes twice a second and reads one file of each, not four."""
        cached = self._info.get(pid)
        if cached is not None and kernelview.still_runs(cached, self.proc):
            return cached
        return self.info(pid)

    def running(self, slots: Set[tuple[int, int, int]]) -> set[tuple[int, int, int]]:
        """Which of these (pid namespace, pid in it, start time) run now. Each is
        found once by a scan of /proc; then only its host pid's stat is read (a
        host pid and a start time name one process, whose pid namespace and
        pid in it never change)."""
        found = set()
        unknown = set()
        running = {}
        for key in slots:
            host_pid = self._host_pids.get(key)
            known = self._known.get(key)
            if host_pid and known is not None and kernelview.still_runs(known, self.proc):
                found.add(key)
                running[host_pid] = known
                continue
            info = kernelview.process_info(host_pid, self.proc) if host_pid else None
            if info is not None and (info.pidns, info.inner_pid, info.start_time) == key \
                    and info.state not in ("Z", "X"):
                found.add(key)
                running[info.pid] = self._known[key] = info
            else:
                self._host_pids.pop(key, None)
                unknown.add(key)
        self._running = running
        if unknown:
            index = self.index({pidns for pidns, _pid, _start in unknown})
            for key in unknown & index.keys():
                self._host_pids[key] = index[key]
                found.add(key)
        if len(self._host_pids) > 4096:
            self._host_pids.clear()
        self._known = {key: info for key, info in self._known.items() if key in found}
        return found

    def host_pid(self, key: tuple[int, int, int]) -> int:
        """The host pid `running` found for a slot's process (0: none)."""
        return self._host_pids.get(key, 0)

    def running_info(self, pid: int) -> kernelview.ProcessInfo | None:
        """What `running` read of host pid `pid` when it first found it, else a
        fresh `info` (a round of `running` and its ownership checks reads
        only the stat of each process it knows)."""
        found = self._running.get(pid)
        return found if found is not None else self.info(pid)

    def index(self, pidns: Set[int]) -> dict[tuple[int, int, int], int]:
        """Every running process of these pid namespaces, as (pid namespace, pid
        in it, start time) -> host pid (one stat for each of the others)."""
        found: dict[tuple[int, int, int], int] = {}
        for pid in kernelview.all_pids(self.proc):
            try:
                if os.stat(f"{self.proc}/{pid}/ns/pid").st_ino not in pidns:
                    continue
            except OSError:
                continue
            info = kernelview.process_info(pid, self.proc)
            if info is not None and info.state not in ("Z", "X"):
                found[info.pidns, info.inner_pid, info.start_time] = pid
        return found


def measure(registry: Registry, nvml: Nvml | None, attribution: Attribution) -> MemoryView:
    """Every container's GPU memory by the kernel's attribution of NVML's processes.

    Containers with no live slot and no process in NVML (most of them, most
    of the time) are left out of every figure: a missing one reads as none."""
    keys = registry.keys()
    figures = {key: found for key, (entry, k) in keys.items()
               if (found := entry.region.slot_figures(k)) is not region_mod.NO_SLOTS}
    gate_wait = {key: found.gate_wait_ns / 1e9 for key, found in figures.items()}
    refusals = {key: found.oom_refusals for key, found in figures.items()}
    if nvml is None:
        return MemoryView(by_container={}, gate_wait=gate_wait, oom_refusals=refusals)
    by_pid, used = nvml.memory_by_pid()
    owners = registry.owner_index(keys, attribution.host, attribution.proc)
    procs: dict[Key, dict[int, int]] = {key: {} for key in figures}
    unmanaged: dict[Key, set[int]] = {}
    identity: dict[int, tuple[int, int, int]] = {}
    stray: dict[int, dict[int, int]] = {}
    seen: dict[str, list[region_mod.Seen]] = {}
    for (gpu, pid), size in sorted(by_pid.items()):
        info = attribution.known_info(pid)
        name = owners.find(info) if info is not None else None
        key = (gpu, name or "")
        if name is None or key not in keys or info is None:
            stray.setdefault(gpu, {})[pid] = size
            continue
        procs.setdefault(key, {})[pid] = size
        identity[pid] = (info.pidns, info.inner_pid, info.start_time)
        seen.setdefault(name, []).append(region_mod.Seen(keys[key][1], *identity[pid], size))
        if key not in figures or identity[pid] not in figures[key].identities:
            unmanaged.setdefault(key, set()).add(pid)
    # libcgpu claims a process's slot before it makes a context, so a slot
    # claimed after the first look but before NVML's is in a second look.
    for key, pids in unmanaged.items():
        entry, k = keys[key]
        again = entry.region.slot_figures(k).identities
        pids.difference_update({pid for pid in pids if identity[pid] in again})
    return MemoryView(
        by_container={key: ContainerMemory(found, frozenset(unmanaged.get(key, ())))
                      for key, found in procs.items()},
        used_by_gpu=used, stray=stray, gate_wait=gate_wait, oom_refusals=refusals,
        seen={name: tuple(found) for name, found in seen.items()})
