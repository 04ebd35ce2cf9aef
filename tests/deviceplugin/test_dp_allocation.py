"""The device plugin's pure core: units, IDs, binpacking and Allocate's environment."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cgpu_km.deviceplugin.allocation import (
    GIB,
    AllocationError,
    Inventory,
    device_id,
    parse_device_id,
    units_of,
)

MIB = 1 << 20
T4_MIB = 15109


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    memory_total: int


GPUS = [Gpu(i, f"GPU-0000000{i}-aaaa-bbbb-cccc-ddddeeeeffff", T4_MIB * MIB) for i in range(4)]
U = [g.uuid for g in GPUS]


def ids(gpu: int, units: range | list[int]) -> list[str]:
    return [device_id(U[gpu], j) for j in units]


@pytest.fixture
def inv() -> Inventory:
    return Inventory(GPUS, GIB)


def test_units_round_up_to_whole_gib_or_mib() -> None:
    assert units_of(T4_MIB * MIB, GIB) == 15
    assert units_of(16 * GIB, GIB) == 16
    assert units_of(16 * GIB + 1, GIB) == 17
    assert units_of(T4_MIB * MIB, MIB) == T4_MIB
    with pytest.raises(ValueError, match="positive"):
        units_of(0, GIB)


def test_device_ids_are_gpushare_form(inv: Inventory) -> None:
    all_ids = inv.device_ids()
    assert len(all_ids) == 4 * 15
    assert all_ids[0] == f"{U[0]}-_-0"
    assert all_ids[-1] == f"{U[3]}-_-14"
    assert parse_device_id(f"{U[2]}-_-7") == (U[2], 7)
    for bad in ("GPU-x", "GPU-x-_-", "-_-3", "GPU-x-_-a"):
        with pytest.raises(AllocationError, match="malformed") as err:
            parse_device_id(bad)
        assert err.value.code == "INVALID_ARGUMENT"


def test_mib_units_give_one_device_per_mib() -> None:
    inv = Inventory(GPUS[:1], MIB)
    assert inv.gpus[0].units == T4_MIB
    assert len(inv.device_ids()) == T4_MIB


def test_preferred_fits_on_an_empty_node_uses_lowest_index(inv: Inventory) -> None:
    chosen = inv.preferred(inv.device_ids(), [], 6)
    assert chosen == ids(0, range(6))


def test_preferred_binpacks_onto_the_fullest_gpu_that_fits(inv: Inventory) -> None:
    # GPU0 has 3 free, GPU1 has 8 free, GPU2 has 15, GPU3 has 7 free.
    available = [
        *ids(0, range(12, 15)),
        *ids(1, range(7, 15)),
        *ids(2, range(15)),
        *ids(3, range(8, 15)),
    ]
    assert inv.preferred(available, [], 6) == ids(3, range(8, 14))
    assert inv.preferred(available, [], 8) == ids(1, range(7, 15))
    assert inv.preferred(available, [], 3) == ids(0, range(12, 15))
    assert inv.preferred(available, [], 15) == ids(2, range(15))


def test_preferred_honours_must_include(inv: Inventory) -> None:
    available = ids(0, range(10)) + ids(1, range(15))
    chosen = inv.preferred(available, ids(1, [9]), 4)
    assert chosen == ids(1, [9, 0, 1, 2])


def test_preferred_that_cannot_fit_on_one_gpu_is_resource_exhausted(inv: Inventory) -> None:
    available = ids(0, range(5)) + ids(1, range(5)) + ids(2, range(4))
    with pytest.raises(AllocationError, match="6 units of GiB do not fit on any one GPU") as err:
        inv.preferred(available, [], 6)
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert "most free units on one GPU is 5" in err.value.message
    with pytest.raises(AllocationError, match="do not fit on GPU 2"):
        inv.preferred(available, ids(2, [0]), 5)


def test_preferred_must_include_spanning_gpus_is_invalid(inv: Inventory) -> None:
    with pytest.raises(AllocationError, match=r"must_include spans GPUs 0 .*, 1 ") as err:
        inv.preferred(inv.device_ids(), ids(0, [0]) + ids(1, [0]), 2)
    assert err.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize(
    ("available", "must", "size", "message"),
    [
        (ids(0, range(3)), [], 0, "size must be positive"),
        (["GPU-nope-_-0"], [], 1, "unknown device ID"),
        (ids(0, [15]), [], 1, "unknown device ID"),
        (ids(0, range(3)), ids(0, [1, 1]), 2, "twice"),
        (ids(0, range(3)), ids(0, [0, 1]), 1, "more than the size"),
    ],
)
def test_preferred_bad_requests(
    inv: Inventory, available: list[str], must: list[str], size: int, message: str
) -> None:
    with pytest.raises(AllocationError, match=message) as err:
        inv.preferred(available, must, size)
    assert err.value.code == "INVALID_ARGUMENT"


def test_allocate_envs_for_one_gpu(inv: Inventory) -> None:
    (env,) = inv.allocate([ids(2, range(3, 9))])
    assert env == {
        "NVIDIA_VISIBLE_DEVICES": U[2],
        "ALIYUN_COM_GPU_MEM_IDX": "2",
        "ALIYUN_COM_GPU_MEM_POD": "6",
        "ALIYUN_COM_GPU_MEM_CONTAINER": "6",
        "ALIYUN_COM_GPU_MEM_DEV": "15",
    }


def test_allocate_pod_total_spans_containers(inv: Inventory) -> None:
    first, second = inv.allocate([ids(0, range(2)), ids(3, range(5))])
    assert (first["ALIYUN_COM_GPU_MEM_IDX"], first["ALIYUN_COM_GPU_MEM_CONTAINER"]) == ("0", "2")
    assert (second["ALIYUN_COM_GPU_MEM_IDX"], second["ALIYUN_COM_GPU_MEM_CONTAINER"]) == ("3", "5")
    assert first["ALIYUN_COM_GPU_MEM_POD"] == second["ALIYUN_COM_GPU_MEM_POD"] == "7"


def test_allocate_spanning_gpus_is_refused(inv: Inventory) -> None:
    with pytest.raises(AllocationError, match=r"container request 0 spans GPUs 0 .*, 1 ") as err:
        inv.allocate([ids(0, range(3)) + ids(1, range(3))])
    assert err.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize(
    ("request_ids", "message"),
    [([], "has no devices"), (["junk"], "malformed"), (["GPU-zz-_-1"], "unknown device ID")],
)
def test_allocate_bad_requests(inv: Inventory, request_ids: list[str], message: str) -> None:
    with pytest.raises(AllocationError, match=message):
        inv.allocate([request_ids])


def test_devices_by_health_marks_missing_and_unhealthy_gpus(inv: Inventory) -> None:
    devices = dict(inv.devices_by_health({U[0]: True, U[1]: False, U[2]: True}))
    assert devices[f"{U[0]}-_-14"] == "Healthy"
    assert devices[f"{U[1]}-_-0"] == "Unhealthy"
    assert devices[f"{U[3]}-_-0"] == "Unhealthy"  # not reported at all
    assert sum(h == "Healthy" for h in devices.values()) == 30


def test_duplicate_uuids_are_refused() -> None:
    gpu = Gpu(0, "GPU-same", GIB)
    with pytest.raises(ValueError, match="same UUID"):
        Inventory([gpu, Gpu(1, "GPU-same", GIB)], GIB)


def test_allocate_on_the_gpu_the_extender_chose(inv: Inventory) -> None:
    (env,) = inv.allocate([ids(0, range(4))], gpu_index=2)
    assert (env["NVIDIA_VISIBLE_DEVICES"], env["ALIYUN_COM_GPU_MEM_CONTAINER"]) == (U[2], "4")
    with pytest.raises(AllocationError, match="chose GPU 9, which this node does not have") as err:
        inv.allocate([ids(0, range(4))], gpu_index=9)
    assert err.value.code == "FAILED_PRECONDITION"


def test_allocate_more_units_than_the_gpu_has_is_resource_exhausted() -> None:
    small = Inventory([Gpu(0, "GPU-small", 4 * GIB), Gpu(1, "GPU-big", 16 * GIB)], GIB)
    big_ids = [device_id("GPU-big", j) for j in range(6)]
    with pytest.raises(
        AllocationError, match="6 units of GiB do not fit on GPU 0, which has 4"
    ) as err:
        small.allocate([big_ids], gpu_index=0)
    assert err.value.code == "RESOURCE_EXHAUSTED"
