"""Where the plugin learns its GPUs and their health: NVML (or simgpu) behind a small interface.

The plugin takes any object with `gpus()` and `health()`; tests pass fakes. The NVML
source lists GPUs once (`cgpu_km.gpus.discover_gpus`), and on each health poll
re-discovers them: a GPU that is gone is unhealthy. It also drains NVML's critical
Xid events where the driver offers them (simgpu does not), as NVIDIA's own device
plugin does: an Xid that is not an application error makes the GPU unhealthy for
`xid_hold` seconds, after which it is healthy again if it still answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import pynvml

from cgpu_km.deviceplugin.allocation import GpuLike
from cgpu_km.gpus import GpuError, discover_gpus

log = logging.getLogger(__name__)

# Xids caused by the application, not the GPU (as in NVIDIA's k8s-device-plugin):
# graphics engine exception, GPU memory page fault, preemptive cleanup, robust
# channel preemption, video processor exception, ECC page retirement pending.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


class GpuSource(Protocol):
    """What the plugin reads: the GPUs at start, and per poll which UUIDs are healthy."""

    def gpus(self) -> Sequence[GpuLike]: ...
    def health(self) -> Mapping[str, bool]: ...


class XidWatcher:
    """Drains NVML critical-Xid events without blocking; remembers when each GPU last had one."""

    def __init__(self, uuids: Sequence[str], nvml: Any) -> None:
        self._nvml = nvml
        self._event_set: Any = None
        self.last_xid: dict[str, float] = {}
        try:
            nvml.nvmlInit()
            self._event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as err:
            log.info("no NVML Xid events (%s); health comes from discovery only", err)
            return
        for uuid in uuids:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                nvml.nvmlDeviceRegisterEvents(
                    handle, nvml.nvmlEventTypeXidCriticalError, self._event_set
                )
            except nvml.NVMLError as err:
                log.info("GPU %s: no Xid events (%s)", uuid, err)

    def drain(self, now: float) -> None:
        if self._event_set is None:
            return
        nvml = self._nvml
        while True:
            try:
                event = nvml.nvmlEventSetWait(self._event_set, 0)
            except nvml.NVMLError as err:
                if not isinstance(err, nvml.NVMLError_Timeout):
                    log.warning("reading Xid events failed: %s", err)
                return
            xid = int(event.eventData)
            if xid in APPLICATION_XIDS:
                continue
            try:
                uuid = nvml.nvmlDeviceGetUUID(event.device)
            except nvml.NVMLError as err:
                log.warning("Xid %d on a GPU whose UUID NVML cannot tell: %s", xid, err)
                continue
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            log.warning("GPU %s reported critical Xid %d: marking it unhealthy", uuid, xid)
            self.last_xid[uuid] = now


class NvmlGpuSource:
    """GPUs from `discover` (cgpu_km.gpus.discover_gpus by default), health from NVML.

    Raises cgpu_km.gpus.GpuError when the first discovery fails."""

    def __init__(
        self,
        discover: Callable[[], Sequence[GpuLike]] | None = None,
        *,
        nvml: Any = None,
        xid_hold: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._discover: Callable[[], Sequence[GpuLike]] = discover or discover_gpus
        self._gpus = list(self._discover())
        self._xid_hold = xid_hold
        self._clock = clock
        self._xids = XidWatcher([g.uuid for g in self._gpus], nvml or pynvml)

    def gpus(self) -> Sequence[GpuLike]:
        return self._gpus

    def health(self) -> Mapping[str, bool]:
        now = self._clock()
        self._xids.drain(now)
        try:
            present = {g.uuid for g in self._discover()}
        except GpuError as err:  # NVML gone entirely: every GPU is unhealthy
            log.warning("GPU discovery failed: %s", err)
            present = set()
        recent_xid = {uuid for uuid, at in self._xids.last_xid.items() if now - at < self._xid_hold}
        return {g.uuid: g.uuid in present and g.uuid not in recent_xid for g in self._gpus}
