"""cgpu-hook in-process: plan, createRuntime (or prestart) and poststop on a real FUSE tree.

GPU discovery is replaced by a fixed list here; tests/hook/test_runc.py runs
the installed hook under runc with simgpu.
"""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cgpu_km.container import claims, hook, steps
from cgpu_km.container.envplan import MIB
from cgpu_km.container.oci.spec import START_STAGES
from cgpu_km.dataplane import kernelview
from cgpu_km.dataplane import region as region_mod
from cgpu_km.gpus import GpuError, GpuInfo
from cgpu_km.tree import client as treefs
from tests.conftest import MountedTree

GPUS = [GpuInfo(index=i, uuid=f"GPU-{i}000", name="Tesla T4", memory_total=15109 * MIB)
        for i in range(4)]
CONTAINER_ID = "0123456789abcdef0123"
ID12 = CONTAINER_ID[:12]
FOUR = pytest.mark.parametrize("control_tree", [4], indirect=True)


@pytest.fixture(autouse=True)
def fixed_gpus(monkeypatch: pytest.MonkeyPatch) -> list[GpuInfo]:
    gpus = list(GPUS)
    monkeypatch.setattr(hook, "discover_gpus", lambda: gpus)
    monkeypatch.delenv("CGPU_KM_ROOT", raising=False)
    return gpus


def make_bundle(tmp_path: Path, env: dict[str, str]) -> Path:
    bundle = tmp_path / "bundle"
    bundle.mkdir(exist_ok=True)
    config = {"process": {"env": ["PATH=/bin", *(f"{k}={v}" for k, v in env.items())]}}
    (bundle / "config.json").write_text(json.dumps(config))
    return bundle


def run_hook(monkeypatch: pytest.MonkeyPatch, root: Path, command: str, bundle: Path,
             container_id: str = CONTAINER_ID) -> int:
    # A process whose identity can be read: this one (nothing is injected into it:
    # its mount namespace is the hook's own).
    state = {"ociVersion": "1.0.2", "id": container_id, "status": "created",
             "pid": os.getpid(), "bundle": str(bundle)}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(state)))
    return hook.main(["--root", str(root), command])


def registered(root: Path) -> dict[int, dict[str, tuple[int, int, int, int]]]:
    return {
        gpu.index: {name: (c.memsize, c.weight, c.highprio, c.util_limit)
                    for name, c in gpu.containers.items()}
        for gpu in treefs.read_tree(root).gpus
    }


# --- plan ---------------------------------------------------------------------

def test_plan_prints_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = hook.main(["--root", str(tmp_path), "plan", "--env", "ALIYUN_COM_GPU_MEM_CONTAINER=6",
                      "--env", "ALIYUN_COM_GPU_MEM_DEV=15", "--env", "NVIDIA_VISIBLE_DEVICES=2",
                      "--env", "ALIYUN_COM_GPU_SCHD_WEIGHT=3"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"enabled": True, "mode": "cgpu", "oom_script": None, "gpus": [
        {"index": 2, "uuid": "GPU-2000", "name": "Tesla T4", "memsize": 15109 * MIB * 6 // 15,
         "weight": 3, "highprio": 0, "util_limit": 0}]}


def test_plan_reads_own_environment(capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AMP_VGPU_ENABLE", "1")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "GPU-1000,0")
    assert hook.main(["plan", "--root", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "egpu"
    assert [g["index"] for g in out["gpus"]] == [1, 0]


@pytest.mark.parametrize(("args", "message"), [
    (["--env", "ALIYUN_COM_GPU_MEM_CONTAINER=x"],
     "cgpu-hook: ALIYUN_COM_GPU_MEM_CONTAINER: 'x' is not a whole number\n"),
    (["--env", "ALIYUN_COM_GPU_MEM_CONTAINER=1", "--env", "ALIYUN_COM_GPU_SCHD_WEIGHT=17"],
     "cgpu-hook: ALIYUN_COM_GPU_SCHD_WEIGHT: 17 is outside 1..16 (max_inst of GPU 0)\n"),
    (["--env", "NOPE"], "cgpu-hook: --env 'NOPE': expected KEY=VALUE\n"),
])
def test_plan_bad_value_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                args: list[str], message: str) -> None:
    assert hook.main(["--root", str(tmp_path), "plan", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == message


def test_plan_gpu_failure_is_one_line(capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken() -> list[GpuInfo]:
        raise GpuError("NVML: init failed: Driver Not Loaded")
    monkeypatch.setattr(hook, "discover_gpus", broken)
    code = hook.main(["--root", str(tmp_path), "plan", "--env", "AMP_VGPU_ENABLE=1"])
    assert code == 1
    assert capsys.readouterr().err == "cgpu-hook: NVML: init failed: Driver Not Loaded\n"


def test_bad_value_is_reported_even_without_gpus(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(hook, "discover_gpus", lambda: pytest.fail("NVML was consulted"))
    code = hook.main(["--root", str(tmp_path), "plan", "--env", "AMP_VGPU_ENABLE=1",
                      "--env", "GPU_UTIL_PER_DEVICE=lots"])
    assert code == 2
    assert capsys.readouterr().err == \
        "cgpu-hook: GPU_UTIL_PER_DEVICE: 'lots' is not a whole number\n"


def test_disabled_plan_needs_no_gpu(capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(hook, "discover_gpus", lambda: pytest.fail("NVML was consulted"))
    assert hook.main(["--root", str(tmp_path), "plan", "--env", "CGPU_DISABLE=1"]) == 0
    assert json.loads(capsys.readouterr().out)["enabled"] is False


# --- createRuntime or prestart, and poststop, on the FUSE tree ------------------

@FOUR
@pytest.mark.parametrize("start", START_STAGES)
def test_start_registers_on_each_gpu_and_poststop_removes(
    control_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start: str
) -> None:
    bundle = make_bundle(tmp_path, {"ALIYUN_COM_GPU_MEM_CONTAINER": "3,4,5,6",
                                    "ALIYUN_COM_GPU_MEM_DEV": "23",
                                    "ALIYUN_COM_GPU_SCHD_WEIGHT": "2",
                                    "ALIYUN_COM_GPU_HIGH_PRIO": "1",
                                    "GPU_UTIL_PER_DEVICE": "30"})
    assert run_hook(monkeypatch, control_tree, start, bundle) == 0
    assert registered(control_tree) == {
        k: {ID12: (15109 * MIB * c // 23, 2, 1, 30)} for k, c in enumerate([3, 4, 5, 6])}
    assert run_hook(monkeypatch, control_tree, "poststop", bundle) == 0
    assert registered(control_tree) == {k: {} for k in range(4)}
    assert run_hook(monkeypatch, control_tree, "poststop", bundle) == 0  # idempotent


@FOUR
def test_the_hook_at_both_stages_registers_once(
    control_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """prestart then createRuntime for one start (one init process): the
    second call leaves the first's registration and region as they are."""
    bundle = make_bundle(tmp_path, {"ALIYUN_COM_GPU_MEM_CONTAINER": "3"})
    assert run_hook(monkeypatch, control_tree, "prestart", bundle) == 0
    first = registered(control_tree)
    owner = (region_mod.region_path(ID12) / kernelview.OWNER_NAME).read_bytes()
    capsys.readouterr()
    assert run_hook(monkeypatch, control_tree, "createRuntime", bundle) == 0
    assert capsys.readouterr().err == (
        f"cgpu-hook: warning: {ID12} is registered by this start already (the hook is "
        "configured at two stages): nothing to do\n")
    assert registered(control_tree) == first
    assert (region_mod.region_path(ID12) / kernelview.OWNER_NAME).read_bytes() == owner
    assert run_hook(monkeypatch, control_tree, "poststop", bundle) == 0
    assert registered(control_tree) == {k: {} for k in range(4)}


def test_pivoted_is_false_for_a_process_in_the_root() -> None:
    assert not hook.pivoted(os.getpid())
    assert not hook.pivoted(2 ** 22 + 1)  # no such process: the steps will say


def test_pivoted_tells_an_init_that_left_the_root(tmp_path: Path) -> None:
    """Integration (tests/conftest.py): chroot needs root."""
    code = "import os, sys, time; os.chroot(sys.argv[1]); print(flush=True); time.sleep(60)"
    with subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                          stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None
            child.stdout.readline()
            assert hook.pivoted(child.pid)
        finally:
            child.kill()


@FOUR
def test_root_from_environment(control_tree: Path, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = make_bundle(tmp_path, {"ALIYUN_COM_GPU_MEM_CONTAINER": "1",
                                    "NVIDIA_VISIBLE_DEVICES": "GPU-3000"})
    monkeypatch.setenv("CGPU_KM_ROOT", str(control_tree))
    state = {"id": CONTAINER_ID, "bundle": str(bundle)}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(state)))
    assert hook.main(["prestart"]) == 0
    assert list(registered(control_tree)[3]) == [ID12]


@FOUR
def test_failed_step_undoes_everything(control_tree: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    treefs.inst_ctl(control_tree, f"add 2 {ID12} memsize=1000")  # GPU 2 will say EEXIST
    bundle = make_bundle(tmp_path, {"ALIYUN_COM_GPU_MEM_CONTAINER": "1"})
    assert run_hook(monkeypatch, control_tree, "prestart", bundle) == 1
    assert capsys.readouterr().err == (
        f"cgpu-hook: registering container {ID12} on GPU 2 failed: "
        "EEXIST: a container with this id is already registered there\n")
    tree = registered(control_tree)
    assert tree[0] == tree[1] == tree[3] == {}
    assert tree[2] == {ID12: (1000, 1, 0, 0)}  # what was there before is untouched


@FOUR
def test_a_later_step_failing_undoes_registration(control_tree: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int | None, int]] = []

    def failing_step(ctx: steps.HookContext, undo: steps.Undo) -> None:
        seen.append((ctx.pid, len(ctx.plan.gpus)))
        raise steps.HookError("region: no space left")
    monkeypatch.setattr(hook, "PRESTART_STEPS", [hook.register_on_gpus, failing_step])
    bundle = make_bundle(tmp_path, {"ALIYUN_COM_GPU_MEM_CONTAINER": "1"})
    assert run_hook(monkeypatch, control_tree, "prestart", bundle) == 1
    assert seen == [(os.getpid(), 4)]
    assert registered(control_tree) == {k: {} for k in range(4)}


@FOUR
def test_gpu_missing_from_tree_is_enodev_and_undone(
    control_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    fixed_gpus: list[GpuInfo], capsys: pytest.CaptureFixture[str],
) -> None:
    fixed_gpus.append(GpuInfo(index=7, uuid="GPU-7", name="x", memory_total=15109 * MIB))
    bundle = make_bundle(tmp_path, {"ALIYUN_COM_GPU_MEM_CONTAINER": "1"})
    assert run_hook(monkeypatch, control_tree, "prestart", bundle) == 1
    assert "on GPU 7 failed: ENODEV" in capsys.readouterr().err
    assert registered(control_tree) == {k: {} for k in range(4)}


@FOUR
def test_weight_is_checked_against_the_trees_max_inst(
    control_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    treefs.write_node(control_tree, "1/max_inst", 4)
    bundle = make_bundle(tmp_path, {"ALIYUN_COM_GPU_MEM_CONTAINER": "1",
                                    "ALIYUN_COM_GPU_SCHD_WEIGHT": "5"})
    assert run_hook(monkeypatch, control_tree, "prestart", bundle) == 2
    assert capsys.readouterr().err == (
        "cgpu-hook: ALIYUN_COM_GPU_SCHD_WEIGHT: 5 is outside 1..4 (max_inst of GPU 1)\n")
    assert registered(control_tree) == {k: {} for k in range(4)}


@FOUR
@pytest.mark.parametrize("env", [{}, {"ALIYUN_COM_GPU_MEM_CONTAINER": "0"},
                                 {"ALIYUN_COM_GPU_MEM_CONTAINER": "2", "CGPU_DISABLE": "True"},
                                 {"ALIYUN_COM_GPU_MEM_CONTAINER": "2",
                                  "NVIDIA_VISIBLE_DEVICES": "none"}])
@pytest.mark.parametrize("start", START_STAGES)
def test_disabled_container_is_untouched(control_tree: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         env: dict[str, str], start: str) -> None:
    bundle = make_bundle(tmp_path, env)
    assert run_hook(monkeypatch, control_tree, start, bundle) == 0
    assert registered(control_tree) == {k: {} for k in range(4)}
    assert run_hook(monkeypatch, control_tree, "poststop", bundle) == 0


def test_disabled_container_needs_no_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = make_bundle(tmp_path, {})
    assert run_hook(monkeypatch, tmp_path / "absent", "prestart", bundle) == 0
    assert run_hook(monkeypatch, tmp_path / "absent", "poststop", bundle) == 0


@pytest.mark.parametrize("start", START_STAGES)
def test_enabled_container_without_tree_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str],
                                              start: str) -> None:
    bundle = make_bundle(tmp_path, {"ALIYUN_COM_GPU_MEM_CONTAINER": "1"})
    assert run_hook(monkeypatch, tmp_path / "absent", start, bundle) == 1
    assert capsys.readouterr().err.startswith(f"cgpu-hook: no control tree at {tmp_path}")
    assert run_hook(monkeypatch, tmp_path / "absent", "poststop", bundle) == 0


@FOUR
def test_poststop_without_the_tree_still_removes_the_region_and_claim(
        control_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container that stops while cgpu-fuse restarts (the tree gone): nothing of it is
    registered any more, but its region and its claim are still the host's to remove."""
    bundle = make_bundle(tmp_path, {"ALIYUN_COM_GPU_MEM_CONTAINER": "3"})
    assert run_hook(monkeypatch, control_tree, "prestart", bundle) == 0
    assert region_mod.region_path(ID12).exists()
    assert claims.read(ID12) == CONTAINER_ID
    assert run_hook(monkeypatch, tmp_path / "absent", "poststop", bundle) == 0
    assert not region_mod.region_path(ID12).exists()
    assert claims.read(ID12) is None
    assert run_hook(monkeypatch, control_tree, "poststop", bundle) == 0
    assert registered(control_tree) == {k: {} for k in range(4)}


@pytest.mark.parametrize("mounted_tree", [4], indirect=True)
def test_poststop_on_a_dead_fuse_mount_removes_the_region_and_claim(
        mounted_tree: MountedTree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """cgpu-fuse killed, its mount not yet gone: every stat there fails with ENOTCONN.
    The container that stops then still loses its region and claim (the thirty-minute
    soak left one of each behind this way: the hook died of the errno)."""
    root = mounted_tree.root
    bundle = make_bundle(tmp_path, {"ALIYUN_COM_GPU_MEM_CONTAINER": "3"})
    assert run_hook(monkeypatch, root, "prestart", bundle) == 0
    mounted_tree.process.kill()
    mounted_tree.process.wait(timeout=30)
    try:
        with pytest.raises(OSError, match="not connected") as dead:
            os.stat(root / "inst_ctl")
        assert dead.value.errno == errno.ENOTCONN
        assert run_hook(monkeypatch, root, "poststop", bundle) == 0, capsys.readouterr().err
        assert not region_mod.region_path(ID12).exists()
        assert claims.read(ID12) is None
        assert run_hook(monkeypatch, root, "prestart", bundle) == 1
        assert f"no control tree at {root}" in capsys.readouterr().err
    finally:  # os.path.ismount says no on a dead mount: the fixture would leave it
        subprocess.run(["fusermount", "-u", "-z", str(root)], check=False, capture_output=True)


@pytest.mark.parametrize(("stdin", "message"), [
    ("not json", "OCI state on stdin is not JSON"),
    ("[]", "OCI state on stdin is not a JSON object"),
    ('{"bundle": "/x"}', "OCI state on stdin has no container id"),
    ('{"id": "abc"}', "OCI state on stdin has no bundle"),
    ('{"id": "abc", "bundle": "/nonexistent-bundle"}', "cannot read /nonexistent-bundle/"),
])
@pytest.mark.parametrize("command", ["createRuntime", "prestart", "poststop"])
def test_bad_state_is_one_line(monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str], stdin: str, message: str,
                               command: str, tmp_path: Path) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = hook.main(["--root", str(tmp_path), command])
    err = capsys.readouterr().err
    if command == "poststop" and "cannot read" in message:
        assert code == 0  # cleanup of a vanished bundle: nothing to do, no tree here
        return
    assert code == 1
    assert err.startswith(f"cgpu-hook: {message}")
    assert err.count("\n") == 1


def test_old_runtimes_bundle_path_key(tmp_path: Path) -> None:
    state = io.StringIO(json.dumps({"id": "abc", "bundlePath": str(tmp_path)}))
    assert hook.read_state(state) == hook.OciState("abc", tmp_path, None)
    state = io.StringIO(json.dumps({"id": "abc", "bundle": str(tmp_path), "pid": 42}))
    assert hook.read_state(state).pid == 42


def test_config_env_parsing(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"process": {"env": ["A=1", "B=x=y", "NOEQUALS", 5, "A=2"]}}))
    assert hook.container_env(tmp_path) == {"A": "2", "B": "x=y"}
    (tmp_path / "config.json").write_text(json.dumps({"process": {}}))
    assert hook.container_env(tmp_path) == {}
