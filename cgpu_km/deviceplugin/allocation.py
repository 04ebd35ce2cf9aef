"""Pure core of the gpushare device plugin: memory units, device IDs, binpacking, envs.

Each GPU offers one kubelet "device" per memory unit (GiB by default, as gpushare
does), named `<GPU-UUID>-_-<j>`. A container's units must all come from one GPU;
the environment returned by Allocate is what the OCI hook reads
(see docs/design.md, "Environment variables").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

GIB = 1 << 30
MIB = 1 << 20
UNIT_BYTES: Mapping[str, int] = {"GiB": GIB, "MiB": MIB}
ID_SEPARATOR = "-_-"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

ErrorCode = Literal["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "UNAVAILABLE"]


class AllocationError(Exception):
    """A request the plugin refuses; `code` names the gRPC status to answer with."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message


class GpuLike(Protocol):
    """What the plugin needs of a GPU (cgpu_km.gpus.GpuInfo has it)."""

    @property
    def index(self) -> int: ...
    @property
    def uuid(self) -> str: ...
    @property
    def memory_total(self) -> int: ...


@dataclass(frozen=True)
class GpuUnits:
    """One GPU as the plugin offers it: `units` devices of `unit_bytes` each."""

    index: int
    uuid: str
    units: int

    def device_ids(self) -> list[str]:
        return [device_id(self.uuid, j) for j in range(self.units)]


def units_of(memory_total: int, unit_bytes: int) -> int:
    """Units a GPU of `memory_total` bytes offers: rounded up (15109 MiB -> 15 GiB)."""
    if memory_total <= 0:
        raise ValueError(f"GPU memory total must be positive, got {memory_total}")
    return math.ceil(memory_total / unit_bytes)


def device_id(uuid: str, unit: int) -> str:
    return f"{uuid}{ID_SEPARATOR}{unit}"


def parse_device_id(dev_id: str) -> tuple[str, int]:
    """`<uuid>-_-<j>` -> (uuid, j); anything else is INVALID_ARGUMENT."""
    uuid, sep, unit = dev_id.rpartition(ID_SEPARATOR)
    if not sep or not uuid or not unit.isdigit():
        raise AllocationError("INVALID_ARGUMENT", f"malformed device ID {dev_id!r}")
    return uuid, int(unit)


class Inventory:
    """The GPUs of this node in units; answers preferred-allocation and allocate questions."""

    def __init__(self, gpus: Sequence[GpuLike], unit_bytes: int) -> None:
        self.unit_bytes = unit_bytes
        self.gpus = [
            GpuUnits(g.index, g.uuid, units_of(g.memory_total, unit_bytes))
            for g in sorted(gpus, key=lambda g: g.index)
        ]
        self._by_uuid = {g.uuid: g for g in self.gpus}
        if len(self._by_uuid) != len(self.gpus):
            raise ValueError("two GPUs report the same UUID")

    def device_ids(self) -> list[str]:
        return [d for g in self.gpus for d in g.device_ids()]

    def devices_by_health(self, healthy: Mapping[str, bool]) -> list[tuple[str, str]]:
        """(device ID, Healthy|Unhealthy) for every unit; a GPU absent from `healthy` is
        unhealthy."""
        return [
            (d, HEALTHY if healthy.get(g.uuid, False) else UNHEALTHY)
            for g in self.gpus
            for d in g.device_ids()
        ]

    def _group(self, ids: Iterable[str], what: str) -> dict[str, list[int]]:
        """Units per GPU UUID for `ids`, refusing unknown and repeated IDs."""
        groups: dict[str, list[int]] = {}
        seen: set[str] = set()
        for dev_id in ids:
            if dev_id in seen:
                raise AllocationError("INVALID_ARGUMENT", f"{what}: device ID {dev_id!r} twice")
            seen.add(dev_id)
            uuid, unit = parse_device_id(dev_id)
            gpu = self._by_uuid.get(uuid)
            if gpu is None or unit >= gpu.units:
                raise AllocationError("INVALID_ARGUMENT", f"{what}: unknown device ID {dev_id!r}")
            groups.setdefault(uuid, []).append(unit)
        return groups

    def _describe(self, uuids: Iterable[str]) -> str:
        return ", ".join(f"{self._by_uuid[u].index} ({u})" for u in uuids)

    def preferred(
        self, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        """Binpack `size` units onto one GPU: among the GPUs whose available units suffice,
        the one with the fewest (ties: lowest index). `must_include` pins the GPU."""
        if size <= 0:
            raise AllocationError(
                "INVALID_ARGUMENT", f"allocation size must be positive, got {size}"
            )
        must = self._group(must_include, "must_include")
        if len(must) > 1:
            raise AllocationError(
                "INVALID_ARGUMENT",
                f"must_include spans GPUs {self._describe(must)}: "
                "a container's units must come from one GPU",
            )
        if len(must_include) > size:
            raise AllocationError(
                "INVALID_ARGUMENT",
                f"must_include has {len(must_include)} devices, more than the size {size}",
            )
        free = self._group(list(dict.fromkeys([*must_include, *available])), "available")
        candidates = [g for g in self.gpus if len(free.get(g.uuid, ())) >= size]
        if must:
            candidates = [g for g in candidates if g.uuid in must]
        if not candidates:
            largest = max((len(v) for v in free.values()), default=0)
            where = f" on GPU {self._describe(must)}" if must else " on any one GPU"
            raise AllocationError(
                "RESOURCE_EXHAUSTED",
                f"{size} units of {self.unit_name()} do not fit{where}: "
                f"the most free units on one GPU is {largest}",
            )
        chosen = min(candidates, key=lambda g: (len(free[g.uuid]), g.index))
        pinned = sorted(must.get(chosen.uuid, []))
        rest = sorted(set(free[chosen.uuid]) - set(pinned))
        units = pinned + rest[: size - len(pinned)]
        return [device_id(chosen.uuid, j) for j in units]

    def allocate(
        self, container_requests: Sequence[Sequence[str]], gpu_index: int | None = None
    ) -> list[dict[str, str]]:
        """The environment for each container of one Allocate call (one pod).

        The GPU is the one the device IDs are on, or `gpu_index` when the scheduler
        extender chose it (then the IDs only count units)."""
        chosen = None
        if gpu_index is not None:
            chosen = next((g for g in self.gpus if g.index == gpu_index), None)
            if chosen is None:
                raise AllocationError(
                    "FAILED_PRECONDITION",
                    f"the scheduler extender chose GPU {gpu_index}, "
                    f"which this node does not have (GPUs 0..{len(self.gpus) - 1})",
                )
        placements: list[tuple[GpuUnits, int]] = []
        for n, ids in enumerate(container_requests):
            groups = self._group(ids, f"container request {n}")
            if not groups:
                raise AllocationError("INVALID_ARGUMENT", f"container request {n} has no devices")
            if chosen is not None:
                placements.append((chosen, len(ids)))
                continue
            if len(groups) > 1:
                raise AllocationError(
                    "INVALID_ARGUMENT",
                    f"container request {n} spans GPUs {self._describe(groups)}: "
                    "a container's units must come from one GPU",
                )
            ((uuid, units),) = groups.items()
            placements.append((self._by_uuid[uuid], len(units)))
        for gpu in {gpu for gpu, _ in placements}:
            wanted = sum(units for g, units in placements if g == gpu)
            if wanted > gpu.units:
                raise AllocationError(
                    "RESOURCE_EXHAUSTED",
                    f"{wanted} units of {self.unit_name()} do not fit on GPU {gpu.index}, "
                    f"which has {gpu.units}",
                )
        pod_units = sum(units for _, units in placements)
        return [
            {
                "NVIDIA_VISIBLE_DEVICES": gpu.uuid,
                "ALIYUN_COM_GPU_MEM_IDX": str(gpu.index),
                "ALIYUN_COM_GPU_MEM_POD": str(pod_units),
                "ALIYUN_COM_GPU_MEM_CONTAINER": str(units),
                "ALIYUN_COM_GPU_MEM_DEV": str(gpu.units),
            }
            for gpu, units in placements
        ]

    def unit_name(self) -> str:
        return next(
            (k for k, v in UNIT_BYTES.items() if v == self.unit_bytes), f"{self.unit_bytes}B"
        )
