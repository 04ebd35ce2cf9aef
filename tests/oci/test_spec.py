"""The config.json edits: cgpu-hook's entries, simgpu's mounts and visible devices."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cgpu_km.container.oci.spec import (
    START_STAGES,
    HookCall,
    SimGpu,
    features_hooks,
    gpu_device_nodes,
    is_cgpu_hook,
    start_stage,
    visible_devices,
    with_agreeing_visible,
    with_hooks,
    with_simgpu,
    with_simgpu_env,
)

HOOK = HookCall(path="/usr/local/bin/cgpu-hook", root="/proc/cgpu_km", env=("PATH=/bin",))
LIBNETWORK = {"path": "/usr/bin/dockerd", "args": ["libnetwork-setkey", "-exec-root=/x", "id"]}
SIM = SimGpu(folder=Path("/opt/cgpu_km/simgpu"), state=Path("/dev/shm/state"))


def docker_config() -> dict[str, Any]:
    return {"ociVersion": "1.0.2", "hooks": {"prestart": [LIBNETWORK]},
            "process": {"env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=1,0"]},
            "mounts": [{"destination": "/dev/shm", "type": "tmpfs", "source": "shm"}]}


@pytest.mark.parametrize("start", START_STAGES)
def test_hooks_come_after_docker_s_and_editing_twice_is_once(start: str) -> None:
    config = docker_config()
    once = with_hooks(config, HOOK, start)
    assert once["hooks"][start][-1] == {
        "path": "/usr/local/bin/cgpu-hook", "args": ["cgpu-hook", "--root", "/proc/cgpu_km",
                                                     start],
        "env": ["PATH=/bin"], "timeout": 30}
    assert once["hooks"]["prestart"][0] == LIBNETWORK  # docker's stays where it was
    assert once["hooks"]["poststop"][0]["args"][-1] == "poststop"
    assert with_hooks(once, HOOK, start) == once
    assert config == docker_config()  # not changed in place


def test_an_older_cgpu_hook_entry_is_replaced() -> None:
    old = {"path": "/old/bin/cgpu-hook", "args": ["cgpu-hook", "prestart"]}
    config = {"hooks": {"prestart": [old, LIBNETWORK], "poststop": [old]}}
    edited = with_hooks(config, HookCall(path="/new/cgpu-hook"), "prestart")
    assert [h["path"] for h in edited["hooks"]["prestart"]] == ["/usr/bin/dockerd",
                                                                "/new/cgpu-hook"]
    assert [h["path"] for h in edited["hooks"]["poststop"]] == ["/new/cgpu-hook"]


def test_moving_to_createruntime_leaves_no_prestart_call() -> None:
    once = with_hooks(docker_config(), HOOK, "prestart")
    moved = with_hooks(once, HOOK, "createRuntime")
    assert moved["hooks"]["prestart"] == [LIBNETWORK]
    assert [h["args"][-1] for h in moved["hooks"]["createRuntime"]] == ["createRuntime"]
    back = with_hooks(moved, HOOK, "prestart")
    assert back["hooks"] == {**once["hooks"], "createRuntime": []}


def test_a_config_cannot_add_a_call_at_any_stage() -> None:
    """Entries that run cgpu-hook by another path, name or stage are all taken
    out: the only calls left are the wrapper's own, one per stage."""
    sneaky = [
        {"path": "/tmp/x/cgpu-hook", "args": ["cgpu-hook", "--root", "/tmp/fake", "poststop"]},
        {"path": "/usr/local/bin/renamed", "args": ["/usr/local/bin/cgpu-hook", "prestart"]},
        {"path": HOOK.path, "args": ["anything"]},
        {"path": "/usr/local/bin/same-file", "args": ["x"]},
    ]
    config = {"hooks": {stage: list(sneaky) for stage in
                        ("prestart", "createRuntime", "createContainer", "startContainer",
                         "poststart", "poststop")}}
    edited = with_hooks(config, HOOK, "createRuntime",
                        lambda path: path == "/usr/local/bin/same-file")
    assert edited["hooks"] == {"prestart": [], "createRuntime": [HOOK.entry("createRuntime")],
                               "createContainer": [], "startContainer": [], "poststart": [],
                               "poststop": [HOOK.entry("poststop")]}


def test_what_counts_as_cgpu_hook() -> None:
    assert is_cgpu_hook({"path": "/a/cgpu-hook"})
    assert is_cgpu_hook({"path": "/a/b", "args": ["cgpu-hook"]})
    assert is_cgpu_hook({"path": "/a/b"}, "/a/b")
    assert not is_cgpu_hook({"path": "/a/b", "args": ["b", "cgpu-hook"]}, "/a/c")
    assert not is_cgpu_hook({"path": "/a/cgpu-hook-not"})
    assert not is_cgpu_hook("cgpu-hook")
    assert not is_cgpu_hook({"path": 3, "args": "cgpu-hook"}, "/a/b", lambda path: True)


def test_only_a_start_stage_is_one() -> None:
    for stage in ("poststart", "startContainer", "createContainer", "poststop", "Prestart"):
        with pytest.raises(ValueError, match="is not a start stage"):
            with_hooks(docker_config(), HOOK, stage)


RUNC_1_1 = ('{"ociVersionMin": "1.0.0", "ociVersionMax": "1.0.2-dev", "hooks": ["prestart", '
            '"createRuntime", "createContainer", "startContainer", "poststart", "poststop"]}')


@pytest.mark.parametrize(("output", "hooks", "stage"), [
    (RUNC_1_1, {"prestart", "createRuntime", "createContainer", "startContainer",
                "poststart", "poststop"}, "createRuntime"),
    ('{"hooks": ["prestart", "poststop"]}', {"prestart", "poststop"}, "prestart"),
    ('{"ociVersionMax": "1.2.0"}', None, "prestart"),  # no list: cannot tell
    ('{"hooks": "createRuntime"}', None, "prestart"),
    ('{"hooks": ["createRuntime", 1]}', None, "prestart"),
    ('["createRuntime"]', None, "prestart"),
    ("Incorrect Usage: unknown command features", None, "prestart"),
    ("", None, "prestart"),
])
def test_the_start_stage_comes_from_what_features_lists(
        output: str, hooks: set[str] | None, stage: str) -> None:
    assert features_hooks(output) == (None if hooks is None else frozenset(hooks))
    assert start_stage(features_hooks(output)) == stage


@given(st.none() | st.frozensets(st.sampled_from(
    ["prestart", "createRuntime", "createContainer", "startContainer", "poststart",
     "poststop", "createruntime", ""])))
def test_the_start_stage_is_createruntime_only_when_listed(hooks: frozenset[str] | None) -> None:
    stage = start_stage(hooks)
    assert stage in START_STAGES
    assert (stage == "createRuntime") == (hooks is not None and "createRuntime" in hooks)


def test_simgpu_mounts_read_only_but_the_state_and_visible_devices() -> None:
    edited = with_simgpu(docker_config(), SIM)
    mounts = {m["destination"]: (m["source"], "ro" in m.get("options", []))
              for m in edited["mounts"]}
    assert mounts == {
        "/dev/shm": ("shm", False),
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1": ("/opt/cgpu_km/simgpu/libcuda.so.1", True),
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1":
            ("/opt/cgpu_km/simgpu/libnvidia-ml.so.1", True),
        "/usr/bin/nvidia-smi": ("/opt/cgpu_km/simgpu/nvidia-smi", True),
        "/dev/shm/simgpu-state": ("/dev/shm/state", False),
    }
    assert edited["mounts"][0]["destination"] == "/dev/shm"  # its mounts go after it
    assert edited["process"]["env"][-1] == "SIMGPU_VISIBLE_DEVICES=1,0"
    assert with_simgpu(edited, SIM) == edited


def test_visible_devices_follow_the_hook_s_variables() -> None:
    assert visible_devices({}) is None
    assert visible_devices({"NVIDIA_VISIBLE_DEVICES": "all"}) is None
    assert visible_devices({"NVIDIA_VISIBLE_DEVICES": "none"}) == "none"
    assert visible_devices({"NVIDIA_VISIBLE_DEVICES": "void"}) == "none"
    assert visible_devices({"NVIDIA_VISIBLE_DEVICES": "0, 2"}) == "0,2"
    assert visible_devices({"ALIYUN_COM_GPU_VISIBLE_DEVICES": "3",
                            "NVIDIA_VISIBLE_DEVICES": "all"}) == "3"
    assert visible_devices({"ALIYUN_COM_GPU_VISIBLE_DEVICES": "",
                            "NVIDIA_VISIBLE_DEVICES": "1"}) == "1"


def test_exec_process_gets_the_container_s_gpus() -> None:
    process = {"args": ["nvidia-smi"], "env": ["NVIDIA_VISIBLE_DEVICES=1",
                                               "SIMGPU_VISIBLE_DEVICES=0,1"]}
    assert with_simgpu_env(process)["env"] == ["NVIDIA_VISIBLE_DEVICES=1",
                                               "SIMGPU_VISIBLE_DEVICES=1"]
    plain = {"args": ["sh"], "env": ["PATH=/bin"]}
    assert with_simgpu_env(plain) == plain


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                       lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
HOOK_ENTRY = st.fixed_dictionaries({"path": st.sampled_from(
    ["/usr/bin/dockerd", "/usr/bin/nvidia-container-runtime-hook", "/x/cgpu-hook"]),
    "args": st.lists(st.text(max_size=5), max_size=3)})


STAGE_NAMES = ["prestart", "poststop", "createRuntime", "poststart", "createContainer"]


@given(st.dictionaries(st.sampled_from(STAGE_NAMES), st.lists(HOOK_ENTRY, max_size=3)),
       st.dictionaries(st.sampled_from(["ociVersion", "root", "annotations"]), JSONISH,
                       max_size=3),
       st.sampled_from(START_STAGES))
def test_hooks_edit_keeps_the_rest_and_is_idempotent(
        hooks: dict[str, list[dict[str, Any]]], rest: dict[str, Any], start: str) -> None:
    config = {**rest, "hooks": hooks}
    edited = with_hooks(config, HOOK, start)
    assert with_hooks(edited, HOOK, start) == edited
    assert {k: v for k, v in edited.items() if k != "hooks"} == rest
    for stage in {*hooks, start, "poststop"}:
        others = [e for e in hooks.get(stage, []) if not e["path"].endswith("/cgpu-hook")]
        ours = [HOOK.entry(stage)] if stage in (start, "poststop") else []
        assert edited["hooks"][stage] == [*others, *ours]
    calls = [e for entries in edited["hooks"].values() for e in entries if is_cgpu_hook(e)]
    assert calls == [HOOK.entry(start), HOOK.entry("poststop")] or \
        calls == [HOOK.entry("poststop"), HOOK.entry(start)]
    json.dumps(edited)


def test_nvidia_s_list_is_made_to_name_the_limited_gpus_when_it_names_all() -> None:
    def nvidia(*env: str) -> list[str]:
        edited = with_agreeing_visible({"env": ["PATH=/bin", *env]})
        return [p for p in edited["env"] if p.startswith("NVIDIA_VISIBLE_DEVICES=")]
    assert nvidia("ALIYUN_COM_GPU_VISIBLE_DEVICES=1") == ["NVIDIA_VISIBLE_DEVICES=1"]
    assert nvidia("ALIYUN_COM_GPU_VISIBLE_DEVICES=1,0", "NVIDIA_VISIBLE_DEVICES=all") == [
        "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=1,0"]  # the last one counts
    # another list is the hook's to compare; no ALIYUN list: nothing to agree with
    assert nvidia("ALIYUN_COM_GPU_VISIBLE_DEVICES=1", "NVIDIA_VISIBLE_DEVICES=0") == [
        "NVIDIA_VISIBLE_DEVICES=0"]
    assert nvidia("NVIDIA_VISIBLE_DEVICES=all") == ["NVIDIA_VISIBLE_DEVICES=all"]


def test_gpu_device_nodes_are_read_by_major_and_minor_whatever_their_path() -> None:
    devices = [{"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1},
               {"path": "/dev/renamed", "type": "c", "major": 195, "minor": 3},
               {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
               {"path": "/dev/nvidia-modeset", "type": "c", "major": 195, "minor": 254},
               {"path": "/dev/sda", "type": "b", "major": 195, "minor": 2},
               {"path": "/dev/null", "type": "c", "major": 1, "minor": 3},
               {"path": "/dev/odd", "type": "c", "major": 195, "minor": True}, "junk"]
    assert gpu_device_nodes({"linux": {"devices": devices}}) == [1, 3]
    assert gpu_device_nodes({}) == []
    assert gpu_device_nodes({"linux": {"devices": "x"}}) == []
