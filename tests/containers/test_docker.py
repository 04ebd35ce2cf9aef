"""A real dockerd (docker.io 20.10) with cgpu-container-runtime as the runtime `cgpu`,
on a simulated host (simgpu with two T4s, a FUSE tree): containers run the way
the cGPU documents run them, and the tree, the limits inside and the errors
are checked. One private engine per module (cgpu_km.demo.dockerd), its containers
removed after each test."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpu_km import paths
from cgpu_km.container.oci.settings import DEFAULT_PATH
from cgpu_km.demo.dockerd import PrivateDocker
from tests.attacks.node import build_rawlaunch
from tests.containers.helpers import (
    CGPU_6_OF_15,
    CUDA_OOM,
    DEVICES,
    IMAGE,
    LIMIT_6_OF_15,
    NOTHING,
    UUIDS,
    VENV_BIN,
    RecordingRunc,
    SimHost,
    missing,
    run_detached,
)

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(missing("dockerd", "containerd", "runc") is not None,
                       reason=f"{missing('dockerd', 'containerd', 'runc')} is not installed "
                              "(apt-get install docker.io)"),
]


def wait_for_log(docker: PrivateDocker, name: str, text: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while True:
        logs = docker.docker("logs", name).stdout
        if text in logs or time.monotonic() > deadline:
            return logs
        time.sleep(0.1)


def test_running_container_is_registered_and_limited_in_exec_too(
        docker: PrivateDocker, sim: SimHost) -> None:
    dockerid = run_detached(docker, "gpu_test1", *CGPU_6_OF_15, "-e", "NVIDIA_VISIBLE_DEVICES=0")
    assert len(dockerid) == 12
    assert sim.registered() == {0: {dockerid: LIMIT_6_OF_15}, 1: {}}
    assert f"total={LIMIT_6_OF_15}" in wait_for_log(docker, "gpu_test1", "ready pid=")
    # docker exec: a new process of the container, with the same limit.
    smi = docker.check("exec", "-i", "gpu_test1", "nvidia-smi")
    assert "1024MiB /  6043MiB" in smi or "1024MiB / 6043MiB" in smi, smi
    assert docker.check("exec", "gpu_test1", "nvidia-smi", "--query-gpu=memory.total",
                        "--format=csv,noheader,nounits") == "6043\n"
    # 1 GiB is held by the main process; the exec process gets what is left.
    over = docker.docker("exec", "gpu_test1", "cuworkload", "--alloc", "5GiB")
    assert f"alloc {5 << 30} {CUDA_OOM}" in over.stdout, over.stdout + over.stderr
    fits = docker.check("exec", "gpu_test1", "cuworkload", "--alloc", "4GiB")
    assert f"total={LIMIT_6_OF_15}" in fits
    assert f"alloc {4 << 30} ok" in fits
    assert docker.check("exec", "gpu_test1", "cat", "/etc/ld.so.preload") == \
        "/usr/local/lib/cgpu/libcgpu.so\n"
    docker.check("stop", "-t", "1", "gpu_test1")
    assert sim.registered() == NOTHING
    assert sim.leftovers() == []


def test_restart_registers_again_and_rm_f_removes(
        docker: PrivateDocker, sim: SimHost, recording_runc: RecordingRunc) -> None:
    """The same with the hook at createRuntime (runc 1.1) and at prestart (a
    runc without `features`): the wrapper puts one call at one stage."""
    dockerid = run_detached(docker, "gpu_restart", *CGPU_6_OF_15)
    both = {0: {dockerid: LIMIT_6_OF_15}, 1: {dockerid: LIMIT_6_OF_15}}
    assert sim.registered() == both
    assert docker.check("exec", "gpu_restart", "cat", "/etc/ld.so.preload") == \
        "/usr/local/lib/cgpu/libcgpu.so\n"
    docker.check("restart", "-t", "1", "gpu_restart")  # poststop, then create and start
    assert sim.registered() == both
    docker.check("stop", "-t", "1", "gpu_restart")
    assert sim.registered() == NOTHING
    docker.check("start", "gpu_restart")
    assert sim.registered() == both
    docker.check("rm", "-f", "gpu_restart")
    assert sim.registered() == NOTHING
    assert sim.leftovers() == []
    assert recording_runc.creates() == [recording_runc.expected()] * 3


def test_container_that_exits_leaves_nothing(docker: PrivateDocker, sim: SimHost) -> None:
    dockerid = run_detached(docker, "gpu_exits", *CGPU_6_OF_15, command=["sleep", "2"])
    assert list(sim.registered()[0]) == [dockerid]
    assert docker.check("wait", "gpu_exits", timeout=30).strip() == "0"
    deadline = time.monotonic() + 10
    while sim.registered() != NOTHING and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sim.registered() == NOTHING
    assert sim.leftovers() == []


@pytest.mark.parametrize(("env", "message"), [
    (["-e", "ALIYUN_COM_GPU_MEM_CONTAINER=3", "-e", "ALIYUN_COM_GPU_MEM_DEV=0"],
     "cgpu-hook: ALIYUN_COM_GPU_MEM_DEV: must be above 0"),
    (["-e", "ALIYUN_COM_GPU_MEM_CONTAINER=3", "-e", "NVIDIA_VISIBLE_DEVICES=0,5"],
     "cgpu-hook: NVIDIA_VISIBLE_DEVICES: no GPU with index '5' on this host (2 GPU(s))"),
])
def test_bad_env_shows_the_hook_s_line_and_registers_nothing(
        docker: PrivateDocker, sim: SimHost, env: list[str], message: str) -> None:
    result = docker.docker("run", "--runtime=cgpu", "--network=none", *env, IMAGE, "true")
    assert result.returncode == 125
    assert f"stderr: {message}: unknown" in result.stderr, result.stderr
    assert sim.registered() == NOTHING
    assert sim.leftovers() == []


def test_exec_sees_the_container_s_gpus_only(docker: PrivateDocker, sim: SimHost) -> None:
    run_detached(docker, "gpu_one", *CGPU_6_OF_15, "-e", "NVIDIA_VISIBLE_DEVICES=1")
    assert docker.check("exec", "gpu_one", "nvidia-smi", "-L") == \
        f"GPU 0: Tesla T4 (UUID: {UUIDS[1]})\n"
    logs = wait_for_log(docker, "gpu_one", "ready pid=")
    assert f"total={LIMIT_6_OF_15}" in logs


def test_container_without_the_variables_is_left_alone(
        docker: PrivateDocker, sim: SimHost) -> None:
    run_detached(docker, "plain", command=["sleep", "600"])
    assert sim.registered() == NOTHING
    # simgpu is there (as NVIDIA's driver would be), but no limit and no libcgpu.
    assert docker.check("exec", "plain", "nvidia-smi", "--query-gpu=memory.total",
                        "--format=csv,noheader,nounits") == "15109\n15109\n"
    assert docker.docker("exec", "plain", "cat", "/etc/ld.so.preload").returncode != 0


def test_wrapper_error_reaches_docker_and_stopping_still_works(
        docker: PrivateDocker, sim: SimHost, runtime_config: Path) -> None:
    run_detached(docker, "before", *CGPU_6_OF_15)
    runtime_config.write_text(runtime_config.read_text() + "\n[extra]\n")
    result = docker.docker("run", "--runtime=cgpu", "--network=none", *CGPU_6_OF_15, IMAGE,
                           "true")
    assert result.returncode == 125
    assert f"cgpu-container-runtime: {runtime_config}: extra: unknown key" in result.stderr
    assert docker.docker("rm", "-f", "before").returncode == 0  # delete goes through
    assert sim.registered() == NOTHING


@contextlib.contextmanager
def running_daemon(sim: SimHost) -> Iterator[Path]:
    """The real `cgpu-daemon` of the simulated host (its log's path)."""
    log = sim.folder / "daemon.log"
    state = sim.folder / "daemon"
    env = {"PATH": DEFAULT_PATH, "CGPU_SIMULATE": "1",
           "CGPU_SIMGPU_DIR": str(paths.simgpu_dir()), "SIMGPU_STATE": str(sim.state),
           "SIMGPU_DEVICES": DEVICES, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with log.open("ab") as out:
        daemon = subprocess.Popen(
            [str(VENV_BIN / "cgpu-daemon"), "--root", str(sim.tree), "--region-dir",
             str(sim.regions), "--state-dir", str(state), "--period", "0.05"],
            env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while not (state / "snapshot.json").exists():
            assert daemon.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the daemon published no snapshot"
            time.sleep(0.05)
        yield log
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)


def test_a_process_that_bypasses_libcgpu_is_stopped(docker: PrivateDocker, sim: SimHost) -> None:
    """Issue 19, item 3, under Docker: root in the container moves /run/cgpu away and runs
    a CUDA program without its region (CGPU_REGION empty). The daemon SIGKILLs it; the
    container's own process, which holds 1 GiB through libcgpu, keeps running."""
    with running_daemon(sim) as log:
        dockerid = run_detached(docker, "gpu_bypass", *CGPU_6_OF_15, "-e",
                                "NVIDIA_VISIBLE_DEVICES=0")
        assert "ready pid=" in wait_for_log(docker, "gpu_bypass", "ready pid=")
        rogue = docker.docker(
            "exec", "gpu_bypass", "sh", "-c", "busybox mv /run/cgpu /run/elsewhere && "
            "CGPU_REGION= exec cuworkload --alloc 64MiB --hold 120", timeout=150)
        assert rogue.returncode == 137, rogue.stdout + rogue.stderr  # SIGKILL
        assert f"container {dockerid} on GPU 0: pid " in log.read_text()
        assert "holds GPU memory without libcgpu (not scheduled): stopping it" in \
            log.read_text()
        state = docker.check("inspect", "--format", "{{.State.Running}}", "gpu_bypass")
        assert state.strip() == "true"
        assert docker.check("exec", "gpu_bypass", "nvidia-smi", "--query-gpu=memory.used",
                            "--format=csv,noheader,nounits") == "1024\n"


def test_a_process_that_launches_past_its_gate_is_stopped(
        docker: PrivateDocker, sim: SimHost, tmp_path: Path) -> None:
    """Issue 36, item 1, under Docker: a process with libcgpu loaded, and so a slot,
    launches through the driver's own cuLaunchKernel (tests/attacks/rawlaunch.c,
    ahead of libcgpu in its LD_PRELOAD). Its container never waits at its gate, so
    it is never granted: what NVML sees it run was not granted, and the daemon
    SIGKILLs it. The container's own process keeps running."""
    library = build_rawlaunch(tmp_path)
    with running_daemon(sim) as log:
        dockerid = run_detached(docker, "gpu_past_gate", *CGPU_6_OF_15, "-e",
                                "NVIDIA_VISIBLE_DEVICES=0")
        assert "ready pid=" in wait_for_log(docker, "gpu_past_gate", "ready pid=")
        docker.check("cp", str(library), "gpu_past_gate:/librawlaunch.so")
        rogue = docker.docker("exec", "-e", "LD_PRELOAD=/librawlaunch.so", "gpu_past_gate",
                              "cuworkload", "--kernels", "20000", "--us", "1000", timeout=150)
        assert rogue.returncode == 137, rogue.stdout + rogue.stderr  # SIGKILL
        judged = [line for line in log.read_text().splitlines()
                  if "s of GPU time in the last" in line]
        assert len(judged) == 1, judged
        assert judged[0].startswith(f"cgpu-daemon: container {dockerid} on GPU 0 used ")
        assert judged[0].endswith("stopping it")
        state = docker.check("inspect", "--format", "{{.State.Running}}", "gpu_past_gate")
        assert state.strip() == "true"
