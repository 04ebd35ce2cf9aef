"""Turn a container's environment into its GPU allocation (pure).

Implements the "Environment variables" section of docs/design.md: the
cGPU and eGPU switches, visible devices, the three memory formulas with the
eGPU reserve, the list rules, and the compute variables. `resolve_plan` either
returns a `Plan` or raises `PlanError` whose message is one line naming the
variable and the reason. Nothing here does I/O.

Choices the cGPU and eGPU documents leave open, which docs/design.md states
(the departures from those documents are listed there too):
- Visible devices: when both variables are unset or empty the container gets
  every GPU of the host; `none` and `void` (the NVIDIA runtime's words for
  "no GPU") give it no GPU, so nothing is registered (`enabled` is false).
- `GPU_MEM_PER_DEVICE`, when set, takes precedence over
  `ALIYUN_COM_GPU_MEM_CONTAINER`; both follow the list rule.
- eGPU with no memory variable: the whole device minus the reserve.
- Any variable set to the empty string counts as unset.
- `ALIYUN_COM_GPU_MEM_RESERVED`, `AMP_USE_HOST_DAEMON` and
  `ALIYUN_COM_GPU_OOM_SCRIPT` are read in eGPU mode only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from cgpu_km.gpus import GpuInfo

MIB = 1 << 20
GIB = 1 << 30
DEFAULT_RESERVED_MIB = 10
DEFAULT_MAX_INST = 16
UTIL_LIMIT_MAX = 95
MAX_DIGITS = 20  # above 2**64: no value of a variable needs more

MEM_CONTAINER = "ALIYUN_COM_GPU_MEM_CONTAINER"
MEM_DEV = "ALIYUN_COM_GPU_MEM_DEV"
MEM_PER_DEVICE = "GPU_MEM_PER_DEVICE"
MEM_RESERVED = "ALIYUN_COM_GPU_MEM_RESERVED"
CGPU_DISABLE = "CGPU_DISABLE"
EGPU_ENABLE = "AMP_VGPU_ENABLE"
EGPU_HOST_DAEMON = "AMP_USE_HOST_DAEMON"
VISIBLE_ALIYUN = "ALIYUN_COM_GPU_VISIBLE_DEVICES"
VISIBLE_NVIDIA = "NVIDIA_VISIBLE_DEVICES"
WEIGHT = "ALIYUN_COM_GPU_SCHD_WEIGHT"
HIGH_PRIO = "ALIYUN_COM_GPU_HIGH_PRIO"
UTIL_PER_DEVICE = "GPU_UTIL_PER_DEVICE"
OOM_SCRIPT = "ALIYUN_COM_GPU_OOM_SCRIPT"
ENFORCE = "CGPU_ENFORCE"  # the node's setting, in cgpu-hook's own environment: 1 = on

Mode = Literal["cgpu", "egpu"]
MemoryKind = Literal["per_device", "container", "whole", "default"]

_UNSIGNED = re.compile(r"[0-9]+", re.ASCII)
_SIGNED = re.compile(r"[+-]?[0-9]+", re.ASCII)
_NO_GPU_WORDS = frozenset({"none", "void"})


class PlanError(ValueError):
    """A bad environment value; `str(error)` is the one-line message."""


@dataclass(frozen=True)
class GpuPlan:
    """What one of the container's GPUs gets (`index` is the host's index)."""

    index: int
    uuid: str
    name: str
    memsize: int
    weight: int
    highprio: int
    util_limit: int


@dataclass(frozen=True)
class Plan:
    """The resolved allocation; `enabled` false means: leave the container alone."""

    enabled: bool
    mode: Mode | None
    gpus: list[GpuPlan] = field(default_factory=list)
    oom_script: str | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "enabled": self.enabled,
            "mode": self.mode,
            "gpus": [asdict(gpu) for gpu in self.gpus],
            "oom_script": self.oom_script,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)


DISABLED = Plan(enabled=False, mode=None)


def _get(env: Mapping[str, str], name: str) -> str | None:
    """The stripped value, or None when unset or empty."""
    value = env.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def _show(text: str) -> str:
    """A value quoted for an error message, kept on one line and short."""
    shown = repr(text)
    return shown if len(shown) <= 60 else shown[:57] + "...'"


def parse_uint(name: str, text: str) -> int:
    """A non-negative decimal integer, or PlanError naming `name`."""
    text = text.strip()
    if _UNSIGNED.fullmatch(text):
        return _digits(name, text)
    if _SIGNED.fullmatch(text) and text.startswith("-"):
        raise PlanError(f"{name}: {_show(text)} is negative")
    raise PlanError(f"{name}: {_show(text)} is not a whole number")


def _digits(name: str, digits: str) -> int:
    """The value of a string of ASCII digits of any length, or PlanError."""
    significant = digits.lstrip("0")
    if len(significant) > MAX_DIGITS:
        raise PlanError(f"{name}: {_show(digits)} is too large (more than {MAX_DIGITS} digits)")
    return int(significant or "0")


def parse_uint_list(name: str, text: str) -> list[int]:
    """A comma list of non-negative integers, or PlanError."""
    items = text.split(",")
    if any(not item.strip() for item in items):
        raise PlanError(f"{name}: {_show(text)} has an empty element")
    return [parse_uint(name, item) for item in items]


def list_element(values: Sequence[int], k: int) -> int:
    """Element k, or the last one when the list is shorter."""
    return values[min(k, len(values) - 1)]


def _is_zero(text: str) -> bool:
    text = text.strip()
    return bool(_UNSIGNED.fullmatch(text)) and not text.strip("0")


def given_a_gpu(env: Mapping[str, str], gpu_nodes: bool = False) -> bool:
    """Whether the runtime gives the container a GPU: a visible-devices variable
    that names one (or all), or GPU device nodes in its config (`gpu_nodes`)."""
    listed = _get(env, VISIBLE_ALIYUN) or _get(env, VISIBLE_NVIDIA)
    return gpu_nodes or (listed is not None and listed.lower() not in _NO_GPU_WORDS)


def _refuse_opt_out(mem: str | None, disabled: bool) -> None:
    why = f"this node enforces cGPU ({ENFORCE}): a container given a GPU cannot opt out"
    if disabled:
        raise PlanError(f"{CGPU_DISABLE}: {why}")
    if mem is not None and any(_is_zero(item) for item in mem.split(",")):
        raise PlanError(f"{MEM_CONTAINER}: {_show(mem)} has a 0 element: {why}")


def switch_mode(env: Mapping[str, str], enforce: bool = False,
                gpu_nodes: bool = False) -> Mode | None:
    """Which switch is on: 'egpu', 'cgpu' or None (leave the container alone).

    On a node that enforces cGPU (`enforce`), every container given a GPU is
    managed, and CGPU_DISABLE or a 0 element is refused instead of obeyed."""
    egpu = _get(env, EGPU_ENABLE)
    if egpu is not None and egpu not in ("0", "1"):
        raise PlanError(f"{EGPU_ENABLE}: {_show(egpu)} is not 0 or 1")
    mem = _get(env, MEM_CONTAINER)
    disable = _get(env, CGPU_DISABLE)
    disabled = disable is not None and disable.lower() in ("true", "1")
    if enforce and given_a_gpu(env, gpu_nodes):
        _refuse_opt_out(mem, disabled)
        return "egpu" if egpu == "1" else "cgpu"
    if egpu == "1":
        return "egpu"
    if mem is None or any(_is_zero(item) for item in mem.split(",")) or disabled:
        return None
    return "cgpu"


GpuList = tuple[int | str, ...]


@dataclass(frozen=True)
class Request:
    """What the environment asks for, parsed and checked without the GPUs.

    `visible` is None for every GPU, else the listed indexes (int) and UUIDs
    (str) in order; `exposed` is NVIDIA_VISIBLE_DEVICES's list when
    ALIYUN_COM_GPU_VISIBLE_DEVICES names the limited ones (False when unset).
    `memory_kind` says which formula applies to `memory_values` (bytes,
    shares of `dev`, the whole device, or the tree's default_memsize on a node
    that enforces cGPU); `dev` is None when the
    denominator is the device's size in whole GiB. `reserve` is in bytes and
    `weight` None means the default.
    """

    mode: Mode
    visible: GpuList | None
    visible_variable: str
    memory_variable: str
    memory_kind: MemoryKind
    memory_values: tuple[int, ...]
    dev: int | None
    reserve: int
    weight: int | None
    highprio: int
    util_limit: int
    oom_script: str | None
    exposed: GpuList | bool | None = False


def _gpu_list(name: str, text: str | None) -> GpuList | None:
    """A visible-devices value: None for every GPU, () for none, else the items
    (indexes as int, UUIDs as str)."""
    if text is None or text.lower() == "all":
        return None
    if text.lower() in _NO_GPU_WORDS:
        return ()
    items: list[int | str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise PlanError(f"{name}: {_show(text)} has an empty element")
        items.append(_digits(name, item) if _UNSIGNED.fullmatch(item) else item)
    return tuple(items)


def _visible(env: Mapping[str, str]) -> tuple[str, GpuList | None, GpuList | bool | None]:
    """(the variable that names the limited GPUs, its list, NVIDIA's list when
    both are set: what NVIDIA's runtime exposes, which must be the same GPUs;
    False when there is nothing to compare)."""
    aliyun = _get(env, VISIBLE_ALIYUN)
    nvidia = _get(env, VISIBLE_NVIDIA)
    if aliyun is None:
        return VISIBLE_NVIDIA, _gpu_list(VISIBLE_NVIDIA, nvidia), False
    exposed = False if nvidia is None else _gpu_list(VISIBLE_NVIDIA, nvidia)
    return VISIBLE_ALIYUN, _gpu_list(VISIBLE_ALIYUN, aliyun), exposed


def _reserve(env: Mapping[str, str], mode: Mode) -> int:
    if mode != "egpu":
        return 0
    text = _get(env, MEM_RESERVED)
    mib = DEFAULT_RESERVED_MIB if text is None else parse_uint(MEM_RESERVED, text)
    return mib * MIB


def _weight(env: Mapping[str, str]) -> int | None:
    text = _get(env, WEIGHT)
    if text is None:
        return None
    weight = parse_uint(WEIGHT, text)
    if weight == 0:
        raise PlanError(f"{WEIGHT}: 0 is below 1")
    return weight


def _flag(env: Mapping[str, str], name: str) -> int:
    text = _get(env, name)
    if text is None:
        return 0
    if text not in ("0", "1"):
        raise PlanError(f"{name}: {_show(text)} is not 0 or 1")
    return int(text)


def _util_limit(env: Mapping[str, str]) -> int:
    text = _get(env, UTIL_PER_DEVICE)
    if text is None:
        return 0
    percent = parse_uint(UTIL_PER_DEVICE, text)
    return percent if percent <= UTIL_LIMIT_MAX else 0


def parse_request(env: Mapping[str, str], enforce: bool = False,
                  gpu_nodes: bool = False) -> Request | None:
    """The checked request, None when no switch is on, or PlanError (`enforce`,
    `gpu_nodes`: see `switch_mode`)."""
    mode = switch_mode(env, enforce, gpu_nodes)
    if mode is None:
        return None
    if mode == "egpu":
        _flag(env, EGPU_HOST_DAEMON)  # accepted; the host daemon is always used
    visible_variable, visible, exposed = _visible(env)
    per_device = _get(env, MEM_PER_DEVICE)
    container = _get(env, MEM_CONTAINER)
    dev: int | None = None
    kind: MemoryKind
    if per_device is not None:
        kind, variable = "per_device", MEM_PER_DEVICE
        values = parse_uint_list(MEM_PER_DEVICE, per_device)
    elif container is not None:
        kind, variable = "container", MEM_CONTAINER
        values = parse_uint_list(MEM_CONTAINER, container)
        dev_text = _get(env, MEM_DEV)
        dev = None if dev_text is None else parse_uint(MEM_DEV, dev_text)
        if dev == 0:
            raise PlanError(f"{MEM_DEV}: must be above 0")
    elif mode == "egpu":
        kind, variable, values = "whole", MEM_RESERVED, []
    else:  # only an enforcing node gets here: the cGPU switch needs MEM_CONTAINER
        kind, variable, values = "default", ENFORCE, []
    return Request(
        mode=mode, visible=visible, visible_variable=visible_variable,
        memory_variable=variable, memory_kind=kind, memory_values=tuple(values), dev=dev,
        reserve=_reserve(env, mode), weight=_weight(env), highprio=_flag(env, HIGH_PRIO),
        util_limit=_util_limit(env),
        oom_script=_get(env, OOM_SCRIPT) if mode == "egpu" else None, exposed=exposed,
    )


def listed_gpus(name: str, listed: GpuList | None, gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
    """The GPUs a visible-devices list names, in its order, or PlanError."""
    if listed is None:
        return list(gpus)
    by_index = {gpu.index: gpu for gpu in gpus}
    by_uuid = {gpu.uuid.lower(): gpu for gpu in gpus}
    chosen: list[GpuInfo] = []
    for item in listed:
        if isinstance(item, int):
            gpu, what = by_index.get(item), "index"
        else:
            gpu, what = by_uuid.get(item.lower()), "UUID"
        if gpu is None:
            raise PlanError(f"{name}: no GPU with {what} {_show(str(item))} on this host "
                            f"({len(gpus)} GPU(s))")
        if gpu in chosen:
            raise PlanError(f"{name}: GPU {gpu.index} is listed twice")
        chosen.append(gpu)
    return chosen


def _indexes(gpus: Sequence[GpuInfo] | Sequence[int]) -> str:
    numbers = sorted(g if isinstance(g, int) else g.index for g in gpus)
    return ",".join(map(str, numbers)) or "none"


def visible_gpus(request: Request, gpus: Sequence[GpuInfo],
                 device_nodes: Sequence[int] = ()) -> list[GpuInfo]:
    """The container's GPUs in its own order (its GPU k is element k).

    They must be every GPU the runtime gives the container: NVIDIA's list
    when ALIYUN_COM_GPU_VISIBLE_DEVICES names the limited ones, and the GPU
    device nodes of its config (`--device`, CDI: `device_nodes`, minor numbers)."""
    name = request.visible_variable
    chosen = listed_gpus(name, request.visible, gpus)
    if not isinstance(request.exposed, bool):
        exposed = listed_gpus(VISIBLE_NVIDIA, request.exposed, gpus)
        if {g.index for g in exposed} != {g.index for g in chosen}:
            raise PlanError(f"{name}: limits GPU(s) {_indexes(chosen)} but {VISIBLE_NVIDIA} "
                            f"gives the container GPU(s) {_indexes(exposed)}: name the same "
                            "GPUs in both")
    unlimited = sorted(set(device_nodes) - {g.index for g in chosen})
    if unlimited:
        raise PlanError(f"{name}: limits GPU(s) {_indexes(chosen)} but the container is also "
                        f"given /dev/nvidia{unlimited[0]}, a GPU without a limit")
    return chosen


def memsize_on(request: Request, gpu: GpuInfo, k: int, default_memsize: int = 0) -> int:
    """Bytes for the container's GPU k (`gpu`), checked against the device
    (`default_memsize`: the tree's, 0 for the whole device)."""
    variable = request.memory_variable
    if gpu.memory_total <= 0:
        raise PlanError(f"{variable}: GPU {gpu.index} reports no memory")
    if request.memory_kind == "default":
        share = min(default_memsize, gpu.memory_total) or gpu.memory_total
    elif request.memory_kind == "per_device":
        share = list_element(request.memory_values, k)
    elif request.memory_kind == "container":
        denominator = request.dev if request.dev is not None else -(-gpu.memory_total // GIB)
        share = gpu.memory_total * list_element(request.memory_values, k) // denominator
    else:
        share = gpu.memory_total
    size = share - request.reserve
    if size <= 0:
        after = f" after the {request.reserve // MIB} MiB reserve" if request.reserve else ""
        raise PlanError(f"{variable}: gives {size} bytes{after} on GPU {gpu.index}, "
                        "which is not above 0")
    if size > gpu.memory_total:
        raise PlanError(f"{variable}: gives {size} bytes on GPU {gpu.index}, above its "
                        f"{gpu.memory_total} bytes")
    return size


def weight_on(request: Request, gpu: GpuInfo, max_inst: int | Mapping[int, int]) -> int:
    if request.weight is None:
        return 1
    limit = max_inst if isinstance(max_inst, int) else max_inst.get(gpu.index,
                                                                      DEFAULT_MAX_INST)
    if request.weight > limit:
        raise PlanError(f"{WEIGHT}: {request.weight} is outside 1..{limit} (max_inst of GPU "
                        f"{gpu.index})")
    return request.weight


def place(request: Request | None, gpus: Sequence[GpuInfo],
          max_inst: int | Mapping[int, int] = DEFAULT_MAX_INST,
          device_nodes: Sequence[int] = (), default_memsize: int = 0) -> Plan:
    """The plan for a parsed request on the host `gpus`, or PlanError
    (`device_nodes`: see `visible_gpus`; `default_memsize`: `memsize_on`)."""
    if request is None:
        return DISABLED
    chosen = visible_gpus(request, gpus, device_nodes)
    if not chosen:
        return DISABLED
    planned = [
        GpuPlan(index=gpu.index, uuid=gpu.uuid, name=gpu.name,
                memsize=memsize_on(request, gpu, k, default_memsize),
                weight=weight_on(request, gpu, max_inst),
                highprio=request.highprio, util_limit=request.util_limit)
        for k, gpu in enumerate(chosen)
    ]
    return Plan(enabled=True, mode=request.mode, gpus=planned, oom_script=request.oom_script)


def resolve_plan(
    env: Mapping[str, str],
    gpus: Sequence[GpuInfo],
    max_inst: int | Mapping[int, int] = DEFAULT_MAX_INST,
) -> Plan:
    """The container's allocation on the host `gpus`, or PlanError.

    `max_inst` bounds the weight: one value for every GPU, or per GPU index.
    Every value that does not depend on the GPUs is checked first
    (`parse_request`), so a bad value is reported even before discovery.
    """
    return place(parse_request(env), gpus, max_inst)
