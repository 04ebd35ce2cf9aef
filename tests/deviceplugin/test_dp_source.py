"""The NVML GPU source: health from re-discovery and from critical Xid events (fake NVML)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from cgpu_km.deviceplugin.source import NvmlGpuSource
from cgpu_km.gpus import GpuError, GpuInfo

GPUS = [GpuInfo(i, f"GPU-{i}", "Tesla T4", 15109 << 20) for i in range(3)]


class FakeNvml:
    """The part of pynvml that the Xid watcher uses; events are queued by the test."""

    class NVMLError(Exception):
        pass

    class NVMLError_Timeout(NVMLError):  # pynvml spells it so
        pass

    nvmlEventTypeXidCriticalError = 8

    def __init__(self, events_supported: bool = True) -> None:
        self.events_supported = events_supported
        self.events: list[SimpleNamespace] = []
        self.registered: list[str] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlEventSetCreate(self) -> object:
        if not self.events_supported:
            raise self.NVMLError("Not Supported")
        return object()

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return uuid

    def nvmlDeviceRegisterEvents(self, handle: str, kind: int, event_set: object) -> None:
        assert kind == self.nvmlEventTypeXidCriticalError
        self.registered.append(handle)

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0, "the watcher must never block"
        if not self.events:
            raise self.NVMLError_Timeout("Timeout")
        return self.events.pop(0)

    def nvmlDeviceGetUUID(self, handle: str) -> bytes:
        return handle.encode()

    def xid(self, uuid: str, xid: int) -> None:
        self.events.append(SimpleNamespace(device=uuid, eventData=xid))


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def present() -> list[GpuInfo]:
    return list(GPUS)


def make_source(present: list[GpuInfo], nvml: Any, clock: Clock) -> NvmlGpuSource:
    return NvmlGpuSource(lambda: list(present), nvml=nvml, xid_hold=60.0, clock=clock)


def test_lists_gpus_and_reports_all_healthy(present: list[GpuInfo]) -> None:
    nvml = FakeNvml()
    source = make_source(present, nvml, Clock())
    assert [g.uuid for g in source.gpus()] == ["GPU-0", "GPU-1", "GPU-2"]
    assert nvml.registered == ["GPU-0", "GPU-1", "GPU-2"]
    assert source.health() == {"GPU-0": True, "GPU-1": True, "GPU-2": True}


def test_gpu_that_disappears_turns_unhealthy_and_back(present: list[GpuInfo]) -> None:
    source = make_source(present, FakeNvml(), Clock())
    lost = present.pop(1)
    assert source.health() == {"GPU-0": True, "GPU-1": False, "GPU-2": True}
    present.insert(1, lost)
    assert source.health()["GPU-1"] is True


def test_critical_xid_makes_a_gpu_unhealthy_for_the_hold_time(present: list[GpuInfo]) -> None:
    nvml, clock = FakeNvml(), Clock()
    source = make_source(present, nvml, clock)
    nvml.xid("GPU-2", 79)  # fallen off the bus
    nvml.xid("GPU-0", 13)  # an application's fault: ignored
    assert source.health() == {"GPU-0": True, "GPU-1": True, "GPU-2": False}
    clock.now += 59
    assert source.health()["GPU-2"] is False
    clock.now += 2
    assert source.health()["GPU-2"] is True


def test_without_nvml_events_health_comes_from_discovery(present: list[GpuInfo]) -> None:
    source = make_source(present, FakeNvml(events_supported=False), Clock())
    assert all(source.health().values())
    present.clear()
    assert not any(source.health().values())


def test_failing_discovery_makes_every_gpu_unhealthy() -> None:
    calls = 0

    def discover() -> list[GpuInfo]:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise GpuError("NVML: counting GPUs failed: GPU is lost")
        return list(GPUS)

    source = NvmlGpuSource(discover, nvml=FakeNvml(), clock=Clock())
    assert source.health() == {"GPU-0": False, "GPU-1": False, "GPU-2": False}
