"""The real data plane for the daemon: containers' regions (gates, activity) and NVML.

`RegionPlane` implements `cgpu_km.daemon_io.Plane`:

- regions: `<region dir>/<container>.region` (`cgpu_km.region`), opened when
  the tree lists the container, reopened when the file is replaced; the
  container's GPU k is the one whose `host_index` is the tree's GPU.
- GPU time per process from NVML's process utilization samples (integrated
  over their time stamps), memory per process from NVML's running
  processes; both are keyed by host pid and mapped to containers through
  the region's process slots (pid namespace inode + pid in it).
- activity: launches blocked at the gate, launches since the last sample, or
  a launch within the last `ACTIVE_HOLD_NS`;
  regions without processes are looked at every `FULL_SCAN_EVERY` samples.

Every NVML failure for a field gives "unknown" for it, never an exception
out of the daemon's loop (as gpustat does).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgpu_km import region as region_mod
from cgpu_km.daemon_io import Key, OpenPlane, Plane, PlaneSample, ProcessMemory, stop_processes

log = logging.getLogger("cgpu-daemon")


# A container stays active this long after its last launch: with long kernels its
# processes wait inside the driver for queue space (neither launching nor at the
# gate) while other containers' work runs, and they must keep their credit.
ACTIVE_HOLD_NS = 1_000_000_000

# Every this many samples all regions are scanned for processes; in between only
# those that had processes (a new process in an idle container waits for a scan).
FULL_SCAN_EVERY = 10


def host_pid_identity(pid: int) -> tuple[int, int] | None:
    """(pid namespace inode, pid inside it) of a host pid, from /proc; None if gone."""
    try:
        pidns = os.stat(f"/proc/{pid}/ns/pid").st_ino
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return pidns, int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return pidns, pid


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
        self._last_seen: dict[int, int] = {}
        self._busy: dict[tuple[int, int], float] = {}  # (gpu, pid) -> seconds
        self._stamp: dict[tuple[int, int], int] = {}

    def busy_by_pid(self) -> dict[tuple[int, int], float]:
        """Cumulative GPU busy seconds per (gpu, host pid), integrated from samples."""
        for gpu, handle in self.handles.items():
            last = self._last_seen.get(gpu, 0)
            try:
                samples = self.nvml.nvmlDeviceGetProcessUtilization(handle, last)
            except self.nvml.NVMLError:
                continue
            newest = last
            for sample in samples:
                key = (gpu, int(sample.pid))
                stamp = int(sample.timeStamp)
                if stamp <= last:
                    continue
                # simgpu reports one sample per process covering [last, stamp];
                # NVML may report several: each covers the time since the previous.
                since = max(last, self._stamp.get(key, 0))
                if last and stamp > since:
                    self._busy[key] = self._busy.get(key, 0.0) + (
                        int(sample.smUtil) / 100.0 * (stamp - since) / 1e6
                    )
                self._stamp[key] = stamp
                newest = max(newest, stamp)
            self._last_seen[gpu] = newest
        return dict(self._busy)

    def memory_by_pid(self) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
        """Bytes per (gpu, host pid) from the running compute processes, and used per GPU."""
        procs: dict[tuple[int, int], int] = {}
        used: dict[int, int] = {}
        for gpu, handle in self.handles.items():
            with contextlib.suppress(self.nvml.NVMLError):
                for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    size = proc.usedGpuMemory
                    procs[gpu, int(proc.pid)] = int(size) if size is not None else 0
            with contextlib.suppress(self.nvml.NVMLError):
                used[gpu] = int(self.nvml.nvmlDeviceGetMemoryInfo(handle).used)
        return procs, used


@dataclass
class _Attached:
    region: region_mod.Region
    inode: int


class RegionPlane:
    """Gates and activity in the regions, GPU time and memory from NVML."""

    def __init__(self, directory: Path, nvml: Nvml | None) -> None:
        self.directory = directory
        self.nvml = nvml
        self.regions: dict[str, _Attached] = {}
        self.keys: dict[Key, tuple[region_mod.Region, int]] = {}
        self._containers: Mapping[int, Set[str]] = {}
        self._launches: dict[Key, int] = {}
        self._usage: dict[Key, float] = {}
        self._pid_cache: dict[int, tuple[int, int] | None] = {}
        self._with_procs: set[str] = set()
        self._samples = 0
        self._gate_wait: dict[Key, float] = {}
        self._oom: dict[Key, int] = {}

    # -- regions --

    def attach(self, containers: Mapping[int, Set[str]]) -> None:
        self._containers = containers
        names = {name for gpu_names in containers.values() for name in gpu_names}
        for name in set(self.regions) - names:
            self.regions.pop(name).region.close()
        for name in names:
            path = region_mod.region_path(name, self.directory)
            try:
                inode = path.stat().st_ino
            except FileNotFoundError:
                if name in self.regions:
                    self.regions.pop(name).region.close()
                continue
            known = self.regions.get(name)
            if known is not None and known.inode == inode:
                continue
            try:
                opened = region_mod.Region.open(path)
            except region_mod.RegionError as error:
                log.warning("container %s: %s", name, error)
                continue
            if known is not None:
                known.region.close()
            self.regions[name] = _Attached(opened, inode)
        self.keys = {}
        for gpu, gpu_names in containers.items():
            for name in gpu_names:
                attached = self.regions.get(name)
                if attached is None:
                    continue
                k = attached.region.gpu_for_host(gpu)
                if k is not None:
                    self.keys[gpu, name] = (attached.region, k)

    def _processes(self, every: bool = True) -> dict[str, list[region_mod.ProcView]]:
        """Live process slots of every region, or only of those that had some at the
        last full scan (a region without processes costs nothing between scans)."""
        names = list(self.regions) if every else [n for n in self._with_procs
                                                  if n in self.regions]
        procs = {name: self.regions[name].region.processes() for name in names}
        if every:
            self._with_procs = {name for name, views in procs.items() if views}
        return procs

    def _containers_of(
        self, by_gpu_pid: Set[tuple[int, int]], procs: dict[str, list[region_mod.ProcView]]
    ) -> dict[tuple[int, int], Key]:
        """(gpu, host pid) -> container, matching (pid namespace, pid) to the regions' slots."""
        owners = {(p.pidns, p.pid): name for name, views in procs.items() for p in views}
        result: dict[tuple[int, int], Key] = {}
        for gpu, pid in by_gpu_pid:
            identity = self._pid_cache.get(pid)
            if identity is None:
                identity = host_pid_identity(pid)
                self._pid_cache[pid] = identity
            if identity is None:
                continue
            name = owners.get(identity) or owners.get((0, identity[1]))
            if name is not None and (gpu, name) in self.keys:
                result[gpu, pid] = (gpu, name)
        if len(self._pid_cache) > 4096:
            self._pid_cache.clear()
        return result

    # -- Plane --

    def sample(self) -> PlaneSample:
        busy = self.nvml.busy_by_pid() if self.nvml is not None else {}
        self._samples += 1
        full_scan = self._samples % FULL_SCAN_EVERY == 1
        if full_scan and any(name not in self.regions
                             for names in self._containers.values() for name in names):
            # cgpu-run and the hook register a container before they create its
            # region: look again for the regions that were missing at attach.
            self.attach(self._containers)
        procs_by_name = self._processes(every=full_scan)
        owners = self._containers_of(set(busy), procs_by_name)
        usage: dict[Key, float] = {}
        for gpu_pid, seconds in busy.items():
            key = owners.get(gpu_pid)
            if key is not None:
                usage[key] = usage.get(key, 0.0) + seconds
        # A process that exits takes its seconds along: keep the container's total monotone.
        for key, seconds in usage.items():
            self._usage[key] = max(self._usage.get(key, 0.0), seconds)
        active: set[Key] = set()
        now_ns = time.monotonic_ns()
        for key, (_region, k) in self.keys.items():
            procs = procs_by_name.get(key[1])
            if procs is None:
                continue  # no process at the last full scan: idle, figures unchanged
            launches = sum(p.launches[k] for p in procs)
            pending = sum(p.pending[k] for p in procs)
            latest = max((p.last_launch_ns[k] for p in procs), default=0)
            if (pending > 0 or launches != self._launches.get(key, launches)
                    or (latest and now_ns - latest < ACTIVE_HOLD_NS)):
                active.add(key)
            self._launches[key] = launches
            self._gate_wait[key] = sum(p.gate_wait_ns[k] for p in procs) / 1e9
            self._oom[key] = sum(p.oom_refusals[k] for p in procs)
        return PlaneSample(usage=dict(self._usage), active=active,
                           gate_wait=dict(self._gate_wait), oom_refusals=dict(self._oom))

    def set_gates(self, gpu: int, open_: Set[str]) -> None:
        for (g, name), (region, k) in self.keys.items():
            if g == gpu:
                region.set_gate(k, name in open_)

    def heartbeat(self) -> None:
        for attached in self.regions.values():
            attached.region.heartbeat()

    def open_all(self) -> None:
        for region, k in self.keys.values():
            region.set_gate(k, True)

    def memory(self) -> ProcessMemory:
        if self.nvml is None:
            return ProcessMemory(by_container={})
        by_pid, used = self.nvml.memory_by_pid()
        owners = self._containers_of(set(by_pid), self._processes())
        by_container: dict[Key, dict[int, int]] = {key: {} for key in self.keys}
        for (gpu, pid), size in by_pid.items():
            key = owners.get((gpu, pid))
            if key is not None:
                by_container[key][pid] = size
        return ProcessMemory(by_container=by_container, used_by_gpu=used)

    def stop(self, gpu: int, name: str, pids: list[int]) -> None:
        attached = self.regions.get(name)
        script = ""
        if attached is not None and attached.region.mode == "egpu":
            script = attached.region.oom_script
        stop_processes(pids, oom_script=script)


def make_plane(region_dir: str | None) -> Plane:
    """The plane for this host: regions plus NVML (simgpu without a driver)."""
    directory = Path(region_dir) if region_dir else region_mod.region_dir()
    nvml: Nvml | None
    try:
        nvml = Nvml()
    except Exception as error:  # NVML absent or broken: gates still work, usage is unknown
        log.warning("NVML unavailable (%s): no GPU time or memory figures", error)
        nvml = None
    if nvml is None and not directory.exists():
        return OpenPlane()
    return RegionPlane(directory, nvml)
