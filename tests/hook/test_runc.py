"""cgpu-hook under real runc: busybox containers, FUSE tree, simgpu with 4 GPUs.

The hook is configured in each bundle's config.json (hooks.createRuntime, or
hooks.prestart where a test says so, and hooks.poststop, with `--root` in its
args and simgpu in its env), exactly as an operator would configure it. runc
1.1 runs here as root with its default settings (cgroupfs driver, cgroup v1,
no user namespace).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cgpu_km.children import stop_child
from cgpu_km.container.oci.spec import START_STAGES
from cgpu_km.gpus import simgpu_lib_dir
from cgpu_km.tree import client as treefs

VENV_BIN = Path(sys.executable).parent
HOOK = VENV_BIN / "cgpu-hook"
RUNC = shutil.which("runc")
BUSYBOX = shutil.which("busybox")
SIMGPU_NVML = simgpu_lib_dir() / "libnvidia-ml.so.1"
MIB = 1 << 20
UUIDS = [f"GPU-5eed000{i}-0000-4000-8000-00000000000{i}" for i in range(4)]
DEVICES = ",".join(
    f"Tesla T4:15109MiB:{UUIDS[i]}" if i % 2 == 0 else f"Tesla V100-SXM2-16GB:16160MiB:{UUIDS[i]}"
    for i in range(4)
)
TOTALS = [15109 * MIB, 16160 * MIB, 15109 * MIB, 16160 * MIB]

pytestmark = [
    pytest.mark.skipif(RUNC is None, reason="runc not installed (apt-get install runc)"),
    pytest.mark.skipif(BUSYBOX is None, reason="busybox not installed (busybox-static)"),
    pytest.mark.skipif(not SIMGPU_NVML.exists(), reason="simgpu not built (make -C simgpu)"),
    pytest.mark.parametrize("control_tree", [4], indirect=True),
]


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A minimal read-only rootfs: static busybox and a few applet links."""
    root = tmp_path_factory.mktemp("rootfs")
    (root / "bin").mkdir()
    assert BUSYBOX is not None
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in ("sh", "sleep", "cat", "env", "true"):
        (root / "bin" / applet).symlink_to("busybox")
    for folder in ("proc", "dev", "sys", "tmp"):
        (root / folder).mkdir()
    return root


@dataclass
class Runc:
    """Creates bundles and runs containers; deletes them all at teardown."""

    workdir: Path
    rootfs: Path
    tree: Path
    state_file: Path
    created: list[str]
    foreground: list[subprocess.Popen[bytes]]
    start: str = "createRuntime"  # the stage that registers
    command: str | None = None  # the hook's command there, if not the stage's name

    def bundle(self, env: dict[str, str], name: str,
               args: tuple[str, ...] = ("sleep", "600")) -> Path:
        bundle = self.workdir / name
        bundle.mkdir()
        assert RUNC is not None
        subprocess.run([RUNC, "spec", "--bundle", str(bundle)], check=True, timeout=30)
        config = json.loads((bundle / "config.json").read_text())
        config["root"] = {"path": str(self.rootfs), "readonly": True}
        config["process"]["terminal"] = False
        config["process"]["args"] = list(args)
        config["process"]["env"] = ["PATH=/bin", *(f"{k}={v}" for k, v in env.items())]
        hook_env = [f"PATH={os.environ.get('PATH', '/usr/bin:/bin')}", "CGPU_SIMULATE=1",
                    f"SIMGPU_DEVICES={DEVICES}", f"SIMGPU_STATE={self.state_file}",
                    f"CGPU_SIMGPU_DIR={simgpu_lib_dir()}"]
        config["hooks"] = {
            stage: [{"path": str(HOOK), "args": ["cgpu-hook", "--root", str(self.tree), command],
                     "env": hook_env, "timeout": 60}]
            for stage, command in ((self.start, self.command or self.start),
                                   ("poststop", "poststop"))
        }
        (bundle / "config.json").write_text(json.dumps(config, indent=1))
        return bundle

    def run(self, env: dict[str, str]) -> tuple[str, subprocess.CompletedProcess[str]]:
        """`runc run --detach` a sleeping container; returns its id and runc's result."""
        container_id = uuid.uuid4().hex  # unique in its first 12 characters too
        bundle = self.bundle(env, container_id)
        self.created.append(container_id)
        # Files, not pipes: the detached container keeps runc's stdio open.
        out, err = bundle / "runc.out", bundle / "runc.err"
        with out.open("w") as stdout, err.open("w") as stderr:
            assert RUNC is not None
            code = subprocess.run([RUNC, "run", "--detach", "--bundle", str(bundle),
                                   container_id], stdin=subprocess.DEVNULL, stdout=stdout,
                                  stderr=stderr, timeout=120).returncode
        result = subprocess.CompletedProcess(["runc"], code, out.read_text(), err.read_text())
        return container_id, result

    def start_foreground(self, env: dict[str, str], args: tuple[str, ...]
                         ) -> tuple[str, subprocess.Popen[bytes]]:
        """`runc run` without --detach: runc waits for the process, then deletes it."""
        container_id = uuid.uuid4().hex
        bundle = self.bundle(env, container_id, args)
        self.created.append(container_id)
        assert RUNC is not None
        with (bundle / "runc.err").open("w") as stderr:  # the child keeps its own copy
            process = subprocess.Popen([RUNC, "run", "--bundle", str(bundle), container_id],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=stderr)
        self.foreground.append(process)
        return container_id, process

    def status(self, container_id: str) -> str:
        assert RUNC is not None
        state = subprocess.run([RUNC, "state", container_id], capture_output=True, text=True,
                               timeout=30)
        return str(json.loads(state.stdout)["status"]) if state.returncode == 0 else "absent"

    def stop(self, container_id: str) -> None:
        assert RUNC is not None
        subprocess.run([RUNC, "kill", container_id, "KILL"], check=True, timeout=30)
        subprocess.run([RUNC, "delete", "--force", container_id], check=True, timeout=30)

    def cleanup(self) -> None:
        for container_id in self.created:
            assert RUNC is not None
            subprocess.run([RUNC, "delete", "--force", container_id], capture_output=True,
                           timeout=30, check=False)
        for process in self.foreground:
            stop_child(process, 30, signum=None)


@pytest.fixture
def runc(rootfs: Path, control_tree: Path, tmp_path: Path) -> Iterator[Runc]:
    helper = Runc(workdir=tmp_path, rootfs=rootfs, tree=control_tree,
                  state_file=tmp_path / "simgpu-state", created=[], foreground=[])
    try:
        yield helper
    finally:
        helper.cleanup()


def containers(tree: Path) -> dict[int, dict[str, tuple[int, int, int, int]]]:
    """GPU index -> container name -> (memsize, weight, highprio, util_limit)."""
    return {
        gpu.index: {name: (c.memsize, c.weight, c.highprio, c.util_limit)
                    for name, c in gpu.containers.items()}
        for gpu in treefs.read_tree(tree).gpus
    }


EMPTY: dict[int, dict[str, tuple[int, int, int, int]]] = {index: {} for index in range(4)}


@pytest.mark.parametrize("start", START_STAGES)
def test_running_container_is_registered_and_removed_after_delete(
    runc: Runc, control_tree: Path, start: str
) -> None:
    runc.start = start
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "6", "ALIYUN_COM_GPU_MEM_DEV": "15",
           "NVIDIA_VISIBLE_DEVICES": "0", "ALIYUN_COM_GPU_SCHD_WEIGHT": "4",
           "ALIYUN_COM_GPU_HIGH_PRIO": "1"}
    container_id, result = runc.run(env)
    assert result.returncode == 0, result.stderr
    assert runc.status(container_id) == "running"
    memsize = 15109 * MIB * 6 // 15
    assert memsize // MIB == 6043
    assert containers(control_tree) == {**EMPTY, 0: {container_id[:12]: (memsize, 4, 1, 0)}}
    runc.stop(container_id)
    assert runc.status(container_id) == "absent"
    assert containers(control_tree) == EMPTY


def test_multi_gpu_container_gets_each_element(runc: Runc, control_tree: Path) -> None:
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "3,4,5,6", "ALIYUN_COM_GPU_MEM_DEV": "23",
           "GPU_UTIL_PER_DEVICE": "40"}
    container_id, result = runc.run(env)
    assert result.returncode == 0, result.stderr
    id12 = container_id[:12]
    assert containers(control_tree) == {
        k: {id12: (TOTALS[k] * c // 23, 1, 0, 40)} for k, c in enumerate([3, 4, 5, 6])}
    runc.stop(container_id)
    assert containers(control_tree) == EMPTY


def test_visible_devices_by_uuid_in_listed_order(runc: Runc, control_tree: Path) -> None:
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "2,1", "ALIYUN_COM_GPU_MEM_DEV": "8",
           "ALIYUN_COM_GPU_VISIBLE_DEVICES": f"{UUIDS[3]},{UUIDS[0].lower()}"}
    container_id, result = runc.run(env)
    assert result.returncode == 0, result.stderr
    id12 = container_id[:12]
    assert containers(control_tree) == {
        0: {id12: (TOTALS[0] * 1 // 8, 1, 0, 0)}, 1: {}, 2: {},
        3: {id12: (TOTALS[3] * 2 // 8, 1, 0, 0)}}
    runc.stop(container_id)
    assert containers(control_tree) == EMPTY


def test_egpu_container_reserve(runc: Runc, control_tree: Path) -> None:
    env = {"AMP_VGPU_ENABLE": "1", "AMP_USE_HOST_DAEMON": "1", "NVIDIA_VISIBLE_DEVICES": "1",
           "ALIYUN_COM_GPU_MEM_CONTAINER": "5", "ALIYUN_COM_GPU_MEM_DEV": "16"}
    container_id, result = runc.run(env)
    assert result.returncode == 0, result.stderr
    expected = 16160 * MIB * 5 // 16 - 10 * MIB
    assert containers(control_tree)[1] == {container_id[:12]: (expected, 1, 0, 0)}
    runc.stop(container_id)
    assert containers(control_tree) == EMPTY


@pytest.mark.parametrize("env", [
    {},
    {"ALIYUN_COM_GPU_MEM_CONTAINER": "0"},
    {"ALIYUN_COM_GPU_MEM_CONTAINER": "1,0,0"},
    {"ALIYUN_COM_GPU_MEM_CONTAINER": "3", "CGPU_DISABLE": "TRUE"},
])
def test_disabled_container_runs_and_registers_nothing(
    runc: Runc, control_tree: Path, env: dict[str, str]
) -> None:
    container_id, result = runc.run(env)
    assert result.returncode == 0, result.stderr
    assert runc.status(container_id) == "running"
    assert containers(control_tree) == EMPTY
    runc.stop(container_id)
    assert containers(control_tree) == EMPTY


@pytest.mark.parametrize(("env", "message"), [
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "3", "ALIYUN_COM_GPU_MEM_DEV": "0"},
     "cgpu-hook: ALIYUN_COM_GPU_MEM_DEV: must be above 0"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "3", "ALIYUN_COM_GPU_SCHD_WEIGHT": "17"},
     "cgpu-hook: ALIYUN_COM_GPU_SCHD_WEIGHT: 17 is outside 1..16 (max_inst of GPU 0)"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "3", "NVIDIA_VISIBLE_DEVICES": "0,1,7"},
     "cgpu-hook: NVIDIA_VISIBLE_DEVICES: no GPU with index '7' on this host (4 GPU(s))"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "three"},
     "cgpu-hook: ALIYUN_COM_GPU_MEM_CONTAINER: 'three' is not a whole number"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "3", "ALIYUN_COM_GPU_VISIBLE_DEVICES": "0",
      "NVIDIA_VISIBLE_DEVICES": "1"},
     "cgpu-hook: ALIYUN_COM_GPU_VISIBLE_DEVICES: limits GPU(s) 0 but NVIDIA_VISIBLE_DEVICES "
     "gives the container GPU(s) 1: name the same GPUs in both"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "3", "NVIDIA_VISIBLE_DEVICES": "1" * 5000},
     f"cgpu-hook: NVIDIA_VISIBLE_DEVICES: '{'1' * 56}...' is too large (more than 20 digits)"),
])
@pytest.mark.parametrize("start", START_STAGES)
def test_bad_value_fails_the_start_and_registers_nothing(
    runc: Runc, control_tree: Path, env: dict[str, str], message: str, start: str
) -> None:
    runc.start = start
    container_id, result = runc.run(env)
    assert result.returncode != 0
    assert f"stderr: {message}\\n" in result.stderr, result.stderr
    assert runc.status(container_id) in ("absent", "stopped")
    assert containers(control_tree) == EMPTY


def test_conflict_on_a_later_gpu_undoes_the_earlier_ones(
    runc: Runc, control_tree: Path
) -> None:
    first_id, first = runc.run({"ALIYUN_COM_GPU_MEM_CONTAINER": "1",
                                "NVIDIA_VISIBLE_DEVICES": "2"})
    assert first.returncode == 0, first.stderr
    # max_inst 1 on GPU 2 is now full: a container on 0,1,2 fails at GPU 2.
    treefs.write_node(control_tree, "2/max_inst", 1)
    second_id, second = runc.run({"ALIYUN_COM_GPU_MEM_CONTAINER": "1",
                                  "NVIDIA_VISIBLE_DEVICES": "0,1,2"})
    assert second.returncode != 0
    assert runc.status(second_id) in ("absent", "stopped")
    assert "on GPU 2 failed: ENOSPC" in second.stderr, second.stderr
    tree = containers(control_tree)
    assert tree[0] == tree[1] == tree[3] == {}
    assert list(tree[2]) == [first_id[:12]]
    runc.stop(first_id)
    assert containers(control_tree) == EMPTY


def test_two_containers_share_a_gpu(runc: Runc, control_tree: Path) -> None:
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "3", "NVIDIA_VISIBLE_DEVICES": "0"}
    ids = [runc.run({**env, "ALIYUN_COM_GPU_SCHD_WEIGHT": str(w)}) for w in (2, 5)]
    assert all(result.returncode == 0 for _, result in ids)
    gpu0 = treefs.read_tree(control_tree).gpus[0]
    assert {name: c.weight for name, c in gpu0.containers.items()} == {
        ids[0][0][:12]: 2, ids[1][0][:12]: 5}
    assert gpu0.free_weight == 16 - 7
    runc.stop(ids[0][0])
    assert list(containers(control_tree)[0]) == [ids[1][0][:12]]
    runc.stop(ids[1][0])
    assert containers(control_tree) == EMPTY


@pytest.mark.parametrize("start", START_STAGES)
def test_container_that_exits_by_itself_leaves_nothing(runc: Runc, control_tree: Path,
                                                       start: str) -> None:
    runc.start = start
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "2", "NVIDIA_VISIBLE_DEVICES": "1,3"}
    container_id, process = runc.start_foreground(env, ("sleep", "2"))
    seen: dict[int, dict[str, tuple[int, int, int, int]]] = {}
    deadline = time.monotonic() + 30
    while process.poll() is None and time.monotonic() < deadline:
        tree = containers(control_tree)
        if tree[1] and tree[3]:
            seen = tree
            break
        time.sleep(0.05)
    assert process.wait(timeout=60) == 0
    id12 = container_id[:12]
    assert seen == {0: {}, 1: {id12: (TOTALS[1] * 2 // 16, 1, 0, 0)}, 2: {},
                    3: {id12: (TOTALS[3] * 2 // 16, 1, 0, 0)}}
    assert runc.status(container_id) == "absent"
    assert containers(control_tree) == EMPTY


def test_the_hook_at_a_later_stage_refuses_and_runc_stops_the_container(
    runc: Runc, control_tree: Path
) -> None:
    """A config that calls the start command at poststart, once the
    container's process runs: the hook refuses, so runc kills the container."""
    runc.start, runc.command = "poststart", "createRuntime"
    container_id, result = runc.run({"ALIYUN_COM_GPU_MEM_CONTAINER": "3"})
    assert result.returncode != 0
    assert (f"cgpu-hook: container {container_id[:12]} has left the runtime's root "
            "(pivot_root): cgpu-hook createRuntime must run at createRuntime or prestart, "
            "before its processes start") in result.stderr, result.stderr
    assert runc.status(container_id) in ("absent", "stopped")
    assert containers(control_tree) == EMPTY
