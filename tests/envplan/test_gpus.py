"""GPU discovery against a mocked pynvml (and simgpu when it is built)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from cgpu_km import gpus
from cgpu_km.gpus import GpuError, GpuInfo, discover_gpus, simgpu_lib_dir

REPO = Path(__file__).resolve().parents[2]


class FakeNvml:
    """Enough of pynvml for discovery, with injectable failures."""

    def __init__(self, devices: list[tuple[str, str, int]], init_error: int | None = None,
                 fail_on: str | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.fail_on = fail_on
        self.init_calls = 0
        self.shutdowns = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount",
                     "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetIndex", "nvmlDeviceGetUUID",
                     "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo"):
            monkeypatch.setattr(pynvml, name, getattr(self, name))

    def _check(self, name: str) -> None:
        if self.fail_on == name:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None and self.init_calls == 1:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        self._check("count")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetUUID(self, handle: int) -> Any:
        self._check("uuid")
        return self.devices[handle][1].encode()  # older pynvml returns bytes

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self.devices[handle][0]

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(total=self.devices[handle][2])


TWO = [("Tesla T4", "GPU-a", 15109 << 20), ("Tesla V100", "GPU-b", 16160 << 20)]


@pytest.fixture
def no_simgpu_load(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    loads: list[int] = []
    monkeypatch.setattr(gpus, "load_simgpu", lambda: loads.append(1))
    monkeypatch.delenv("CGPU_SIMULATE", raising=False)
    return loads


def test_discovers_gpus_in_order(monkeypatch: pytest.MonkeyPatch,
                                 no_simgpu_load: list[int]) -> None:
    fake = FakeNvml(TWO)
    fake.install(monkeypatch)
    assert discover_gpus() == [GpuInfo(0, "GPU-a", "Tesla T4", 15109 << 20),
                               GpuInfo(1, "GPU-b", "Tesla V100", 16160 << 20)]
    assert no_simgpu_load == []
    assert fake.shutdowns == 1


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
                                  pynvml.NVML_ERROR_DRIVER_NOT_LOADED])
def test_no_driver_falls_back_to_simgpu_with_one_line(
    monkeypatch: pytest.MonkeyPatch, no_simgpu_load: list[int],
    capsys: pytest.CaptureFixture[str], code: int,
) -> None:
    FakeNvml(TWO, init_error=code).install(monkeypatch)
    assert len(discover_gpus()) == 2
    assert no_simgpu_load == [1]
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "using the simulated GPU (simgpu)" in err


def test_simulate_loads_simgpu_first(monkeypatch: pytest.MonkeyPatch,
                                     no_simgpu_load: list[int],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CGPU_SIMULATE", "1")
    FakeNvml(TWO).install(monkeypatch)
    discover_gpus()
    assert no_simgpu_load == [1]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("init_error", "fail_on", "expected"), [
    (pynvml.NVML_ERROR_NO_PERMISSION, None, "NVML: init failed: Insufficient Permissions"),
    (None, "count", "NVML: counting GPUs failed: GPU is lost"),
    (None, "uuid", "NVML: reading GPU 0 failed: GPU is lost"),
])
def test_nvml_errors_become_one_line(monkeypatch: pytest.MonkeyPatch,
                                     no_simgpu_load: list[int], init_error: int | None,
                                     fail_on: str | None, expected: str) -> None:
    fake = FakeNvml(TWO, init_error=init_error, fail_on=fail_on)
    fake.install(monkeypatch)
    with pytest.raises(GpuError, match=f"^{expected}$"):
        discover_gpus()


def test_simulated_init_failure_is_not_retried(monkeypatch: pytest.MonkeyPatch,
                                               no_simgpu_load: list[int]) -> None:
    FakeNvml(TWO, init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND).install(monkeypatch)
    with pytest.raises(GpuError, match=r"^NVML: init failed"):
        discover_gpus(simulate=True)


def test_missing_simgpu_library_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("CGPU_SIMGPU_DIR", str(tmp_path))
    assert simgpu_lib_dir() == tmp_path
    with pytest.raises(GpuError, match=r"simgpu NVML library not found at .*make -C simgpu"):
        gpus.load_simgpu()


def test_default_simgpu_dir_is_in_the_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CGPU_SIMGPU_DIR", raising=False)
    assert simgpu_lib_dir() == REPO / "simgpu"


SIMGPU_NVML = REPO / "simgpu" / "libnvidia-ml.so.1"


@pytest.mark.skipif(not SIMGPU_NVML.exists(), reason="simgpu not built (make -C simgpu)")
def test_discovers_simgpu_devices_through_real_pynvml(tmp_path: Path) -> None:
    # A fresh process: pynvml keeps the loaded library for the process's life.
    devices = "Tesla T4:15109MiB:GPU-11111111-2222-3333-4444-555555555555,Tesla V100:16160MiB"
    code = ("import json; from cgpu_km.gpus import discover_gpus; "
            "print(json.dumps([g.__dict__ for g in discover_gpus()]))")
    env = {"CGPU_SIMULATE": "1", "SIMGPU_DEVICES": devices, "PATH": "/usr/bin:/bin",
           "SIMGPU_STATE": str(tmp_path / "simgpu-state")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, timeout=60)
    found = json.loads(out.stdout)
    assert [(g["index"], g["name"], g["memory_total"]) for g in found] == [
        (0, "Tesla T4", 15109 << 20), (1, "Tesla V100", 16160 << 20)]
    assert found[0]["uuid"] == "GPU-11111111-2222-3333-4444-555555555555"
    assert found[1]["uuid"].startswith("GPU-")


def _real_nvml_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(not SIMGPU_NVML.exists(), reason="simgpu not built (make -C simgpu)")
@pytest.mark.skipif(_real_nvml_present(), reason="this host has an NVIDIA driver")
def test_host_without_driver_falls_back_to_simgpu(tmp_path: Path) -> None:
    code = "from cgpu_km.gpus import discover_gpus; print(len(discover_gpus()))"
    env = {"SIMGPU_DEVICES": "A:1GiB,B:2GiB,C:3GiB", "PATH": "/usr/bin:/bin",
           "SIMGPU_STATE": str(tmp_path / "simgpu-state")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, timeout=60)
    assert out.stdout == "3\n"
    assert out.stderr == ("cgpu_km: no NVIDIA driver (NVML Shared Library Not Found); "
                          "using the simulated GPU (simgpu)\n")
