"""Env-var resolution: the worked examples of docs/design.md and every rule."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgpu_km.container.envplan import (
    DISABLED,
    ENFORCE,
    GIB,
    MIB,
    Plan,
    PlanError,
    list_element,
    parse_request,
    place,
    resolve_plan,
    switch_mode,
)
from cgpu_km.gpus import GpuInfo

T4 = GpuInfo(index=0, uuid="GPU-t4-0000", name="Tesla T4", memory_total=15109 * MIB)
V100 = GpuInfo(index=0, uuid="GPU-v100-0000", name="Tesla V100-SXM2-16GB",
               memory_total=16160 * MIB)
FOUR = [
    GpuInfo(index=i, uuid=f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd", name="Tesla T4",
            memory_total=15109 * MIB)
    for i in range(4)
]


def plan(env: dict[str, str], gpus: list[GpuInfo] | None = None, max_inst: int = 16) -> Plan:
    return resolve_plan(env, FOUR if gpus is None else gpus, max_inst)


def error(env: dict[str, str], gpus: list[GpuInfo] | None = None) -> str:
    with pytest.raises(PlanError) as caught:
        plan(env, gpus)
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- worked examples ------------------------------------------------------

def test_t4_worked_example_shows_6043_mib() -> None:
    result = plan({"ALIYUN_COM_GPU_MEM_CONTAINER": "6", "ALIYUN_COM_GPU_MEM_DEV": "15"}, [T4])
    assert result.enabled
    assert result.mode == "cgpu"
    (gpu,) = result.gpus
    assert gpu.memsize == 15109 * 2**20 * 6 // 15
    assert gpu.memsize // MIB == 6043


def test_v100_egpu_worked_example_subtracts_reserve() -> None:
    env = {"AMP_VGPU_ENABLE": "1", "AMP_USE_HOST_DAEMON": "1",
           "ALIYUN_COM_GPU_MEM_CONTAINER": "5", "ALIYUN_COM_GPU_MEM_DEV": "16"}
    result = plan(env, [V100])
    assert result.mode == "egpu"
    assert result.gpus[0].memsize == 16160 * 2**20 * 5 // 16 - 10 * 2**20


# --- switches -------------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "1,0,0", "", "  ", "3,00"])
def test_cgpu_switch_off(value: str) -> None:
    assert plan({"ALIYUN_COM_GPU_MEM_CONTAINER": value}) == DISABLED


def test_unset_environment_is_disabled() -> None:
    assert plan({}) == DISABLED
    assert DISABLED.to_dict() == {"enabled": False, "mode": None, "gpus": [],
                                  "oom_script": None}


@pytest.mark.parametrize("value", ["true", "TRUE", "True", "1"])
def test_cgpu_disable(value: str) -> None:
    assert plan({"ALIYUN_COM_GPU_MEM_CONTAINER": "3", "CGPU_DISABLE": value}) == DISABLED


@pytest.mark.parametrize("value", ["false", "0", "yes", ""])
def test_cgpu_disable_other_values_keep_it_on(value: str) -> None:
    assert plan({"ALIYUN_COM_GPU_MEM_CONTAINER": "3", "CGPU_DISABLE": value}).enabled


def test_egpu_switch_and_host_daemon() -> None:
    assert switch_mode({"AMP_VGPU_ENABLE": "1"}) == "egpu"
    assert switch_mode({"AMP_VGPU_ENABLE": "0"}) is None
    assert switch_mode({"AMP_VGPU_ENABLE": "0", "ALIYUN_COM_GPU_MEM_CONTAINER": "2"}) == "cgpu"
    assert "AMP_VGPU_ENABLE" in error({"AMP_VGPU_ENABLE": "yes"})
    assert plan({"AMP_VGPU_ENABLE": "1", "AMP_USE_HOST_DAEMON": "1"}).mode == "egpu"
    message = error({"AMP_VGPU_ENABLE": "1", "AMP_USE_HOST_DAEMON": "2"})
    assert message.startswith("AMP_USE_HOST_DAEMON:")


def test_egpu_wins_over_cgpu_and_ignores_cgpu_disable() -> None:
    env = {"AMP_VGPU_ENABLE": "1", "ALIYUN_COM_GPU_MEM_CONTAINER": "2",
           "CGPU_DISABLE": "true"}
    result = plan(env, [T4])
    assert result.mode == "egpu"
    assert result.gpus[0].memsize == 15109 * MIB * 2 // 15 - 10 * MIB


def test_egpu_without_memory_gets_device_minus_reserve() -> None:
    result = plan({"AMP_VGPU_ENABLE": "1", "ALIYUN_COM_GPU_MEM_RESERVED": "100"}, [T4])
    assert result.gpus[0].memsize == 15109 * MIB - 100 * MIB


# --- visible devices ------------------------------------------------------

def test_visible_devices_default_is_all() -> None:
    result = plan({"ALIYUN_COM_GPU_MEM_CONTAINER": "2"})
    assert [g.index for g in result.gpus] == [0, 1, 2, 3]
    assert plan({"ALIYUN_COM_GPU_MEM_CONTAINER": "2", "NVIDIA_VISIBLE_DEVICES": "all"}) == result


@pytest.mark.parametrize("value", ["none", "void", "NONE"])
def test_visible_devices_none_means_no_gpu(value: str) -> None:
    assert plan({"ALIYUN_COM_GPU_MEM_CONTAINER": "2", "NVIDIA_VISIBLE_DEVICES": value}) \
        == DISABLED


def test_visible_devices_order_indexes_uuids_mixed() -> None:
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "1,2,3",
           "NVIDIA_VISIBLE_DEVICES": f"2, {FOUR[0].uuid.upper()},1"}
    result = plan(env)
    assert [g.index for g in result.gpus] == [2, 0, 1]
    assert [g.uuid for g in result.gpus] == [FOUR[2].uuid, FOUR[0].uuid, FOUR[1].uuid]
    assert [g.memsize for g in result.gpus] == [15109 * MIB * c // 15 for c in (1, 2, 3)]


def test_aliyun_visible_devices_name_the_gpus_and_nvidia_must_agree() -> None:
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "1,2", "ALIYUN_COM_GPU_VISIBLE_DEVICES": "3,1"}
    assert [g.index for g in plan(env).gpus] == [3, 1]
    env["NVIDIA_VISIBLE_DEVICES"] = f"1,{FOUR[3].uuid}"  # the same GPUs, named otherwise
    assert [(g.index, g.memsize) for g in plan(env).gpus] == [
        (3, FOUR[3].memory_total * 1 // 15), (1, FOUR[1].memory_total * 2 // 15)]
    env["ALIYUN_COM_GPU_VISIBLE_DEVICES"] = ""
    assert [g.index for g in plan(env).gpus] == [1, 3]


@pytest.mark.parametrize(("aliyun", "nvidia", "shown"), [
    ("0", "1", "limits GPU(s) 0 but NVIDIA_VISIBLE_DEVICES gives the container GPU(s) 1"),
    ("3", "0,1", "limits GPU(s) 3 but NVIDIA_VISIBLE_DEVICES gives the container GPU(s) 0,1"),
    ("0", "all", "limits GPU(s) 0 but NVIDIA_VISIBLE_DEVICES gives the container GPU(s) "
     "0,1,2,3"),
    ("0,1", "0", "limits GPU(s) 0,1 but NVIDIA_VISIBLE_DEVICES gives the container GPU(s) 0"),
    ("none", "2", "limits GPU(s) none but NVIDIA_VISIBLE_DEVICES gives the container GPU(s) 2"),
])
def test_a_gpu_nvidia_gives_without_a_limit_is_refused(aliyun: str, nvidia: str,
                                                       shown: str) -> None:
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "ALIYUN_COM_GPU_VISIBLE_DEVICES": aliyun,
           "NVIDIA_VISIBLE_DEVICES": nvidia}
    assert error(env) == f"ALIYUN_COM_GPU_VISIBLE_DEVICES: {shown}: name the same GPUs in both"


def test_a_gpu_device_node_without_a_limit_is_refused() -> None:
    request = parse_request({"ALIYUN_COM_GPU_MEM_CONTAINER": "1",
                             "NVIDIA_VISIBLE_DEVICES": "0,2"})
    assert [g.index for g in place(request, FOUR, device_nodes=[2, 0]).gpus] == [0, 2]
    with pytest.raises(PlanError) as caught:
        place(request, FOUR, device_nodes=[0, 3])
    assert str(caught.value) == ("NVIDIA_VISIBLE_DEVICES: limits GPU(s) 0,2 but the container "
                                 "is also given /dev/nvidia3, a GPU without a limit")


@pytest.mark.parametrize("variable", [
    "ALIYUN_COM_GPU_MEM_CONTAINER", "ALIYUN_COM_GPU_MEM_DEV", "GPU_MEM_PER_DEVICE",
    "ALIYUN_COM_GPU_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ALIYUN_COM_GPU_SCHD_WEIGHT",
    "GPU_UTIL_PER_DEVICE",
])
@pytest.mark.parametrize("digits", [21, 4301, 100_000])
def test_numbers_of_any_length_get_the_one_line_refusal(variable: str, digits: int) -> None:
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "1", variable: "9" * digits}
    message = error(env)
    assert message.startswith(f"{variable}: '999"), message
    assert message.endswith("is too large (more than 20 digits)"), message
    assert len(message) < 160


def test_zeros_of_any_length_are_zero() -> None:
    assert switch_mode({"ALIYUN_COM_GPU_MEM_CONTAINER": "0" * 5000}) is None
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "0" * 5000 + "6", "ALIYUN_COM_GPU_MEM_DEV": "15"}
    assert plan(env, [T4]).gpus[0].memsize == 15109 * MIB * 6 // 15


@pytest.mark.parametrize(("value", "reason"), [
    ("4", "no GPU with index '4'"),
    ("GPU-nope", "no GPU with UUID 'GPU-nope'"),
    ("0,,1", "empty element"),
    ("1,1", "GPU 1 is listed twice"),
    (f"0,{FOUR[0].uuid}", "GPU 0 is listed twice"),
])
def test_visible_devices_errors(value: str, reason: str) -> None:
    message = error({"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "NVIDIA_VISIBLE_DEVICES": value})
    assert message.startswith("NVIDIA_VISIBLE_DEVICES: ")
    assert reason in message


# --- memory formulas and list rules ----------------------------------------

def test_container_alone_uses_whole_gib_of_device() -> None:
    result = plan({"ALIYUN_COM_GPU_MEM_CONTAINER": "6"}, [T4])
    assert result.gpus[0].memsize == 15109 * MIB * 6 // 15  # 15109 MiB -> 15 GiB
    exact = GpuInfo(index=0, uuid="u", name="x", memory_total=16 * GIB)
    assert plan({"ALIYUN_COM_GPU_MEM_CONTAINER": "16"}, [exact]).gpus[0].memsize == 16 * GIB


def test_per_device_bytes_in_both_modes() -> None:
    assert plan({"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "GPU_MEM_PER_DEVICE": "1000000"},
                [T4]).gpus[0].memsize == 1000000
    egpu = plan({"AMP_VGPU_ENABLE": "1", "GPU_MEM_PER_DEVICE": str(2 * GIB)}, [T4])
    assert egpu.gpus[0].memsize == 2 * GIB - 10 * MIB
    no_reserve = plan({"AMP_VGPU_ENABLE": "1", "GPU_MEM_PER_DEVICE": str(GIB),
                       "ALIYUN_COM_GPU_MEM_RESERVED": "0"}, [T4])
    assert no_reserve.gpus[0].memsize == GIB


def test_reserve_is_ignored_in_cgpu_mode() -> None:
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "6", "ALIYUN_COM_GPU_MEM_DEV": "15",
           "ALIYUN_COM_GPU_MEM_RESERVED": "banana"}
    assert plan(env, [T4]).gpus[0].memsize == 15109 * MIB * 6 // 15


def test_only_the_ratio_counts() -> None:
    a = plan({"ALIYUN_COM_GPU_MEM_CONTAINER": "6", "ALIYUN_COM_GPU_MEM_DEV": "15"}, [T4])
    b = plan({"ALIYUN_COM_GPU_MEM_CONTAINER": "6000", "ALIYUN_COM_GPU_MEM_DEV": "15000"}, [T4])
    assert a == b


@pytest.mark.parametrize(("value", "expected"), [
    ("3", [3, 3, 3, 3]), ("3,1", [3, 1, 1, 1]), ("3,4,5,6", [3, 4, 5, 6]),
    ("3,4,5,6,7", [3, 4, 5, 6]),
])
def test_list_rule(value: str, expected: list[int]) -> None:
    result = plan({"ALIYUN_COM_GPU_MEM_CONTAINER": value, "ALIYUN_COM_GPU_MEM_DEV": "23"})
    assert [g.memsize for g in result.gpus] == [15109 * MIB * c // 23 for c in expected]
    assert list_element([7], 5) == 7


@pytest.mark.parametrize(("env", "variable", "reason"), [
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "16", "ALIYUN_COM_GPU_MEM_DEV": "15"},
     "ALIYUN_COM_GPU_MEM_CONTAINER", "above its"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "abc"}, "ALIYUN_COM_GPU_MEM_CONTAINER",
     "not a whole number"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "-3"}, "ALIYUN_COM_GPU_MEM_CONTAINER", "negative"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "1.5"}, "ALIYUN_COM_GPU_MEM_CONTAINER",
     "not a whole number"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "3,,4"}, "ALIYUN_COM_GPU_MEM_CONTAINER",
     "empty element"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "3", "ALIYUN_COM_GPU_MEM_DEV": "0"},
     "ALIYUN_COM_GPU_MEM_DEV", "above 0"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "3", "ALIYUN_COM_GPU_MEM_DEV": "x"},
     "ALIYUN_COM_GPU_MEM_DEV", "not a whole number"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "3", "ALIYUN_COM_GPU_MEM_DEV": "-15"},
     "ALIYUN_COM_GPU_MEM_DEV", "negative"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "ALIYUN_COM_GPU_MEM_DEV": str(16 * GIB)},
     "ALIYUN_COM_GPU_MEM_CONTAINER", "not above 0"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "GPU_MEM_PER_DEVICE": "0"},
     "GPU_MEM_PER_DEVICE", "not above 0"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "GPU_MEM_PER_DEVICE": str(16 * GIB)},
     "GPU_MEM_PER_DEVICE", "above its"),
    ({"AMP_VGPU_ENABLE": "1", "GPU_MEM_PER_DEVICE": str(5 * MIB)},
     "GPU_MEM_PER_DEVICE", "after the 10 MiB reserve"),
    ({"AMP_VGPU_ENABLE": "1", "ALIYUN_COM_GPU_MEM_RESERVED": "-1"},
     "ALIYUN_COM_GPU_MEM_RESERVED", "negative"),
    ({"AMP_VGPU_ENABLE": "1", "ALIYUN_COM_GPU_MEM_RESERVED": "20000"},
     "ALIYUN_COM_GPU_MEM_RESERVED", "not above 0"),
    ({"AMP_VGPU_ENABLE": "1", "ALIYUN_COM_GPU_MEM_CONTAINER": "0"},
     "ALIYUN_COM_GPU_MEM_CONTAINER", "not above 0"),
])
def test_memory_errors(env: dict[str, str], variable: str, reason: str) -> None:
    message = error(env, [T4])
    assert message.startswith(variable + ": ")
    assert reason in message


def test_zero_memory_device_is_an_error_not_a_crash() -> None:
    empty = GpuInfo(index=0, uuid="u", name="x", memory_total=0)
    assert "reports no memory" in error({"ALIYUN_COM_GPU_MEM_CONTAINER": "1"}, [empty])


# --- compute --------------------------------------------------------------

def test_compute_defaults() -> None:
    gpu = plan({"ALIYUN_COM_GPU_MEM_CONTAINER": "1"}, [T4]).gpus[0]
    assert (gpu.weight, gpu.highprio, gpu.util_limit) == (1, 0, 0)


def test_weight_range_follows_max_inst() -> None:
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "ALIYUN_COM_GPU_SCHD_WEIGHT": "16"}
    assert plan(env, [T4]).gpus[0].weight == 16
    assert "outside 1..16" in error({**env, "ALIYUN_COM_GPU_SCHD_WEIGHT": "17"}, [T4])
    assert error({**env, "ALIYUN_COM_GPU_SCHD_WEIGHT": "0"}, [T4]) == \
        "ALIYUN_COM_GPU_SCHD_WEIGHT: 0 is below 1"
    with pytest.raises(PlanError, match=r"^ALIYUN_COM_GPU_SCHD_WEIGHT: 5 is outside 1\.\.4 "):
        resolve_plan({**env, "ALIYUN_COM_GPU_SCHD_WEIGHT": "5"}, [T4], 4)
    with pytest.raises(PlanError, match=r"max_inst of GPU 1\)$"):
        resolve_plan({**env, "ALIYUN_COM_GPU_SCHD_WEIGHT": "5"}, FOUR[:2], {0: 8, 1: 4})
    ok = resolve_plan({**env, "ALIYUN_COM_GPU_SCHD_WEIGHT": "5"}, FOUR[:2], {0: 8, 1: 5})
    assert [g.weight for g in ok.gpus] == [5, 5]


@pytest.mark.parametrize(("value", "expected"), [("0", 0), ("1", 1), (" 1 ", 1), ("", 0)])
def test_high_prio(value: str, expected: int) -> None:
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "ALIYUN_COM_GPU_HIGH_PRIO": value}
    assert plan(env, [T4]).gpus[0].highprio == expected


@pytest.mark.parametrize("value", ["2", "yes", "-1", "true"])
def test_high_prio_errors(value: str) -> None:
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "ALIYUN_COM_GPU_HIGH_PRIO": value}
    assert error(env, [T4]).startswith("ALIYUN_COM_GPU_HIGH_PRIO: ")


@pytest.mark.parametrize(("value", "expected"), [
    ("", 0), ("0", 0), ("1", 1), ("50", 50), ("95", 95), ("96", 0), ("1000", 0),
])
def test_util_limit(value: str, expected: int) -> None:
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "GPU_UTIL_PER_DEVICE": value}
    assert [g.util_limit for g in plan(env).gpus] == [expected] * 4


@pytest.mark.parametrize("value", ["-5", "half", "50%"])
def test_util_limit_errors(value: str) -> None:
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "GPU_UTIL_PER_DEVICE": value}
    assert error(env).startswith("GPU_UTIL_PER_DEVICE: ")


def test_compute_values_apply_to_every_gpu() -> None:
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "ALIYUN_COM_GPU_SCHD_WEIGHT": "3",
           "ALIYUN_COM_GPU_HIGH_PRIO": "1", "GPU_UTIL_PER_DEVICE": "40"}
    assert {(g.weight, g.highprio, g.util_limit) for g in plan(env).gpus} == {(3, 1, 40)}


def test_oom_script_only_in_egpu_mode() -> None:
    script = {"ALIYUN_COM_GPU_OOM_SCRIPT": "/usr/local/bin/on-oom.sh"}
    assert plan({"AMP_VGPU_ENABLE": "1", **script}).oom_script == "/usr/local/bin/on-oom.sh"
    assert plan({"ALIYUN_COM_GPU_MEM_CONTAINER": "1", **script}).oom_script is None
    assert plan({"AMP_VGPU_ENABLE": "1"}).oom_script is None


def test_plan_json_shape() -> None:
    env = {"AMP_VGPU_ENABLE": "1", "ALIYUN_COM_GPU_MEM_CONTAINER": "5",
           "ALIYUN_COM_GPU_MEM_DEV": "16", "ALIYUN_COM_GPU_OOM_SCRIPT": "/oom"}
    decoded = json.loads(plan(env, [V100]).to_json())
    assert decoded == {
        "enabled": True, "mode": "egpu", "oom_script": "/oom",
        "gpus": [{"index": 0, "uuid": "GPU-v100-0000", "name": "Tesla V100-SXM2-16GB",
                  "memsize": 16160 * MIB * 5 // 16 - 10 * MIB, "weight": 1, "highprio": 0,
                  "util_limit": 0}],
    }


def test_error_values_are_quoted_short_and_on_one_line() -> None:
    message = error({"ALIYUN_COM_GPU_MEM_CONTAINER": "x\n" + "y" * 500})
    assert len(message) < 120


def test_values_are_checked_before_the_gpus_are_known() -> None:
    bad = {"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "ALIYUN_COM_GPU_HIGH_PRIO": "2",
           "NVIDIA_VISIBLE_DEVICES": "9"}
    with pytest.raises(PlanError, match=r"^ALIYUN_COM_GPU_HIGH_PRIO: "):
        parse_request(bad)
    request = parse_request({"ALIYUN_COM_GPU_MEM_CONTAINER": "3,1",
                             "NVIDIA_VISIBLE_DEVICES": f"2,{FOUR[0].uuid}"})
    assert request is not None
    assert request.visible == (2, FOUR[0].uuid)
    assert place(request, FOUR) == plan({"ALIYUN_COM_GPU_MEM_CONTAINER": "3,1",
                                        "NVIDIA_VISIBLE_DEVICES": f"2,{FOUR[0].uuid}"})
    assert parse_request({}) is None
    assert place(None, FOUR) == DISABLED


# --- any environment: a plan or a PlanError --------------------------------

VARIABLES = [
    "ALIYUN_COM_GPU_MEM_CONTAINER", "ALIYUN_COM_GPU_MEM_DEV", "GPU_MEM_PER_DEVICE",
    "ALIYUN_COM_GPU_MEM_RESERVED", "CGPU_DISABLE", "AMP_VGPU_ENABLE", "AMP_USE_HOST_DAEMON",
    "ALIYUN_COM_GPU_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ALIYUN_COM_GPU_SCHD_WEIGHT",
    "ALIYUN_COM_GPU_HIGH_PRIO", "GPU_UTIL_PER_DEVICE", "ALIYUN_COM_GPU_OOM_SCRIPT",
]
NUMBERISH = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.integers(1, 6000).map(lambda n: "1" + "0" * n),
    st.tuples(st.sampled_from(["", "-", "0"]), st.text("0123456789", min_size=15,
                                                       max_size=5000)).map("".join),
    st.lists(st.integers(-3, 40).map(str), min_size=0, max_size=5).map(",".join),
    st.sampled_from(["", "all", "none", "void", "true", "TRUE", "1", "0", "GPU-x", " 1 ",
                     FOUR[1].uuid, "0,1,2,3", "3,2", "\u0663", "1e3", "0x10"]),
    st.text(max_size=12),
)
ENVIRONMENTS = st.dictionaries(st.sampled_from(VARIABLES), NUMBERISH, max_size=len(VARIABLES))
GPU_SETS = st.lists(
    st.builds(GpuInfo, index=st.integers(0, 7), uuid=st.text(max_size=8), name=st.just("G"),
              memory_total=st.integers(0, 2**40)),
    max_size=4, unique_by=(lambda g: g.index, lambda g: g.uuid.lower()),
)


@settings(max_examples=600, deadline=None)
@given(env=ENVIRONMENTS, gpus=GPU_SETS, max_inst=st.integers(1, 25), enforce=st.booleans(),
       nodes=st.lists(st.integers(0, 8), max_size=3), default=st.integers(0, 2**41))
def test_any_environment_gives_a_plan_or_a_plan_error(
    env: dict[str, str], gpus: list[GpuInfo], max_inst: int, enforce: bool, nodes: list[int],
    default: int
) -> None:
    try:
        result = place(parse_request(env, enforce, bool(nodes)), gpus, max_inst, nodes, default)
    except PlanError as caught:
        message = str(caught)
        assert message
        assert "\n" not in message
        # the variable that decided: the container's, or the node's CGPU_ENFORCE
        assert message.split(":", 1)[0] in [*VARIABLES, ENFORCE]
        return
    assert result.enabled == bool(result.gpus)
    for gpu in result.gpus:
        total = next(g.memory_total for g in gpus if g.index == gpu.index)
        assert 0 < gpu.memsize <= total
        assert 1 <= gpu.weight <= max_inst
        assert gpu.highprio in (0, 1)
        assert 0 <= gpu.util_limit <= 95
    json.loads(result.to_json())


# --- a node that enforces cGPU ------------------------------------------------

def enforced(env: dict[str, str], gpu_nodes: bool = False, default_memsize: int = 0) -> Plan:
    return place(parse_request(env, enforce=True, gpu_nodes=gpu_nodes), FOUR,
                 default_memsize=default_memsize)


def test_the_default_leaves_a_container_without_cgpu_variables_alone() -> None:
    for env in ({"NVIDIA_VISIBLE_DEVICES": "0"}, {"NVIDIA_VISIBLE_DEVICES": "0",
                "ALIYUN_COM_GPU_MEM_CONTAINER": "0"},
                {"NVIDIA_VISIBLE_DEVICES": "0", "ALIYUN_COM_GPU_MEM_CONTAINER": "3",
                 "CGPU_DISABLE": "true"}):
        assert switch_mode(env) is None
        assert plan(env) == DISABLED


def test_enforcing_manages_every_container_given_a_gpu_with_the_default_memsize() -> None:
    whole = enforced({"NVIDIA_VISIBLE_DEVICES": "1"})
    assert [(g.index, g.memsize, g.weight) for g in whole.gpus] == [
        (1, FOUR[1].memory_total, 1)]
    assert whole.mode == "cgpu"
    sized = enforced({"NVIDIA_VISIBLE_DEVICES": "all"}, default_memsize=2 * GIB)
    assert [(g.index, g.memsize) for g in sized.gpus] == [(i, 2 * GIB) for i in range(4)]
    assert [g.memsize for g in enforced({"NVIDIA_VISIBLE_DEVICES": "0"},
                                        default_memsize=1 << 50).gpus] == [FOUR[0].memory_total]
    # its own cGPU variables still count; device nodes alone give it a GPU too
    assert [g.memsize for g in enforced({"NVIDIA_VISIBLE_DEVICES": "0",
                                         "ALIYUN_COM_GPU_MEM_CONTAINER": "6",
                                         "ALIYUN_COM_GPU_MEM_DEV": "15"}).gpus] == [
        FOUR[0].memory_total * 6 // 15]
    assert [g.index for g in enforced({}, gpu_nodes=True).gpus] == [0, 1, 2, 3]


def test_enforcing_leaves_a_container_without_a_gpu_alone() -> None:
    for env in ({}, {"NVIDIA_VISIBLE_DEVICES": "none"}, {"NVIDIA_VISIBLE_DEVICES": "void"},
                {"NVIDIA_VISIBLE_DEVICES": ""}):
        assert switch_mode(env, enforce=True) is None


@pytest.mark.parametrize(("env", "message"), [
    ({"CGPU_DISABLE": "true"}, "CGPU_DISABLE: this node enforces cGPU"),
    ({"CGPU_DISABLE": "1"}, "CGPU_DISABLE: this node enforces cGPU"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "0"},
     "ALIYUN_COM_GPU_MEM_CONTAINER: '0' has a 0 element: this node enforces cGPU"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "3,00"},
     "ALIYUN_COM_GPU_MEM_CONTAINER: '3,00' has a 0 element: this node enforces cGPU"),
])
def test_enforcing_refuses_an_opt_out_with_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(PlanError) as caught:
        switch_mode({"NVIDIA_VISIBLE_DEVICES": "0", **env}, enforce=True)
    assert str(caught.value) == (f"{message} (CGPU_ENFORCE): a container given a GPU cannot "
                                 "opt out")
