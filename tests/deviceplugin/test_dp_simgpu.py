"""End to end on simgpu: the real `cgpu-device-plugin` process, a stub kubelet, `cgpu-hook plan`.

The plugin discovers four simulated GPUs of different sizes through NVML
(CGPU_SIMULATE=1), registers, and its Allocate environment, fed to the OCI
hook's planner, gives floor(total * units / DEV) bytes on the chosen GPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cgpu_km.deviceplugin import api_pb2
from cgpu_km.gpus import NVML_SONAME, simgpu_lib_dir
from tests.deviceplugin.doubles import PluginClient, StubKubelet

VENV_BIN = Path(sys.executable).parent
MIB = 1 << 20
# (name, MiB, UUID): GiB units 15, 16, 23, 40.
SIMULATED = [
    ("Tesla T4", 15109, "GPU-5a1e0000-0000-4000-8000-000000000000"),
    ("Tesla V100-SXM2-16GB", 16160, "GPU-5a1e0000-0000-4000-8000-000000000001"),
    ("NVIDIA A10", 22731, "GPU-5a1e0000-0000-4000-8000-000000000002"),
    ("NVIDIA A100-PCIE-40GB", 40960, "GPU-5a1e0000-0000-4000-8000-000000000003"),
]
UNITS = [15, 16, 23, 40]

pytestmark = pytest.mark.skipif(
    not (simgpu_lib_dir() / NVML_SONAME).is_file(),
    reason=f"simgpu is not built ({simgpu_lib_dir() / NVML_SONAME} missing): make -C simgpu",
)


@pytest.fixture
def sim_env(sock_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        CGPU_SIMULATE="1",
        SIMGPU_DEVICES=",".join(f"{name}:{mib}MiB:{uuid}" for name, mib, uuid in SIMULATED),
        SIMGPU_STATE=str(sock_dir / "simgpu-state"),
        CGPU_KM_ROOT=str(sock_dir / "no-tree"),
    )
    return env


@pytest.fixture
def plugin_process(
    sock_dir: Path, sim_env: dict[str, str], stub_kubelet: StubKubelet
) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [
            str(VENV_BIN / "cgpu-device-plugin"),
            f"--kubelet-socket={stub_kubelet.socket}",
            "--health-interval=0.2",
            "--watch-interval=0.05",
        ],
        env=sim_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield process
    if process.poll() is None:
        process.kill()
        process.wait()


def hook_plan(env: dict[str, str], sim_env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run(
        [str(VENV_BIN / "cgpu-hook"), "plan", *(f"--env={k}={v}" for k, v in env.items())],
        env=sim_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    plan: dict[str, Any] = json.loads(result.stdout)  # the JSON cgpu-hook plan prints
    return plan


def test_plugin_on_four_simgpus_drives_the_hook(
    plugin_process: subprocess.Popen[str],
    stub_kubelet: StubKubelet,
    sim_env: dict[str, str],
    sock_dir: Path,
    plugin_client: PluginClient,
) -> None:
    registration = stub_kubelet.next_registration(timeout=30)
    assert registration.resource_name == "aliyun.com/gpu-mem"
    plugin_socket = sock_dir / registration.endpoint

    with plugin_client.connect(plugin_socket) as stub:
        devices = plugin_client.watch(stub).next(timeout=30)
        assert len(devices) == sum(UNITS)
        assert set(devices.values()) == {"Healthy"}
        for (_, _, uuid), units in zip(SIMULATED, UNITS, strict=True):
            assert f"{uuid}-_-{units - 1}" in devices
            assert f"{uuid}-_-{units}" not in devices

        everything = list(devices)
        # (units requested, devices already used on GPU0) -> GPU chosen by binpacking
        for size, used_on_gpu0, expected in [(6, 0, 0), (6, 10, 1), (20, 0, 2), (30, 0, 3)]:
            used = {f"{SIMULATED[0][2]}-_-{j}" for j in range(used_on_gpu0)}
            request = api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=[d for d in everything if d not in used],
                        allocation_size=size,
                    )
                ]
            )
            chosen = list(stub.GetPreferredAllocation(request).container_responses[0].deviceIDs)
            assert {d.rpartition("-_-")[0] for d in chosen} == {SIMULATED[expected][2]}
            assert len(chosen) == size

            allocated = stub.Allocate(
                api_pb2.AllocateRequest(
                    container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=chosen)]
                )
            )
            env = dict(allocated.container_responses[0].envs)
            assert env["ALIYUN_COM_GPU_MEM_IDX"] == str(expected)
            assert env["ALIYUN_COM_GPU_MEM_DEV"] == str(UNITS[expected])
            plan = hook_plan(env, sim_env)
            assert plan["enabled"] is True
            (gpu,) = plan["gpus"]
            total = SIMULATED[expected][1] * MIB
            assert gpu["uuid"] == SIMULATED[expected][2]
            assert gpu["index"] == expected
            assert gpu["memsize"] == total * size // UNITS[expected]

    plugin_process.send_signal(signal.SIGTERM)
    _, stderr = plugin_process.communicate(timeout=15)
    assert plugin_process.returncode == 0, stderr
    assert "SIGTERM: stopping" in stderr
    assert not plugin_socket.exists()


def test_t4_worked_example_six_of_fifteen(sim_env: dict[str, str]) -> None:
    """The cGPU documents' example: 6 of a 15109 MiB T4's 15 units show as 6043 MiB."""
    env = {
        "NVIDIA_VISIBLE_DEVICES": SIMULATED[0][2],
        "ALIYUN_COM_GPU_MEM_CONTAINER": "6",
        "ALIYUN_COM_GPU_MEM_DEV": "15",
    }
    (gpu,) = hook_plan(env, sim_env)["gpus"]
    assert gpu["memsize"] == 15109 * MIB * 6 // 15
    assert gpu["memsize"] // MIB == 6043


HEALTH_PROBE = """
import json, os
from cgpu_km.deviceplugin.source import NvmlGpuSource
source = NvmlGpuSource()
seen = [[g.uuid for g in source.gpus()], source.health()]
os.environ["SIMGPU_VISIBLE_DEVICES"] = "0,1,3"  # GPU 2 falls off the bus
seen.append(source.health())
del os.environ["SIMGPU_VISIBLE_DEVICES"]
seen.append(source.health())
print(json.dumps(seen))
"""


def test_nvml_health_on_simgpu_follows_a_gpu_that_disappears(sim_env: dict[str, str]) -> None:
    result = subprocess.run(
        [sys.executable, "-c", HEALTH_PROBE],
        env=sim_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    uuids, before, lost, back = json.loads(result.stdout)
    assert uuids == [uuid for _, _, uuid in SIMULATED]
    assert before == dict.fromkeys(uuids, True)
    assert lost == {**dict.fromkeys(uuids, True), SIMULATED[2][2]: False}
    assert back == before
