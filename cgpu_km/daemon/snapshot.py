"""The daemon's published state: an immutable snapshot, its JSON form and its file.

Every publish interval (2 s) the daemon builds one `Snapshot` (per-GPU and
per-container figures, its own build and timing), swaps it into the
metrics collector and writes it to `<state dir>/snapshot.json`, where
`cgpu-smi` reads it. Readers never see the scheduler's live state, only
these frozen figures.

Units: bytes, seconds (Unix time for timestamps), ratios from 0 to 1.
Counters (`gpu_time_seconds`, `gate_wait_seconds`, `oom_events`) only grow
while one daemon runs; they restart from 0 with the daemon.

The file is replaced atomically (write a temporary file in the same
folder, then `rename`), so a reader sees either the old or the new
snapshot, never a torn one. It lives on tmpfs (`/run`) and is not synced.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgpu_km.fileio import replace_file

FORMAT = 1
STATE_DIR_ENV = "CGPU_STATE_DIR"
DEFAULT_STATE_DIR = Path("/run/cgpu_km-daemon")
SNAPSHOT_NAME = "snapshot.json"
# A snapshot older than this many periods (and at least FRESH_MIN_SECONDS)
# means the daemon stopped publishing even if its pid still exists.
FRESH_PERIODS = 10
FRESH_MIN_SECONDS = 5.0


class SnapshotError(ValueError):
    """A snapshot file or document is malformed; `str(error)` is one line."""


@dataclass(frozen=True)
class ProcessFigures:
    """One process of a container using memory on its GPU."""

    pid: int
    memory_bytes: int
    managed: bool = True  # False: it bypassed libcgpu (no process slot); counted all the same


@dataclass(frozen=True)
class ContainerFigures:
    """One container on one GPU (a container on two GPUs has two of these)."""

    name: str
    id: int
    gpu: int
    weight: int
    highprio: bool
    util_limit: int  # percent, 0 = none (the tree's node)
    target_share: float  # ratio of GPU time the scheduler gives it now
    utilization: float  # GPU time per second over the last seconds (the daemon's window)
    memory_used_bytes: int
    memory_limit_bytes: int  # effective: the device total when memsize is 0
    gpu_time_seconds: float  # counter: GPU busy time of its kernels
    gate_wait_seconds: float  # counter: time its launches waited at a closed gate (all procs)
    oom_events: int  # counter: allocations refused or processes stopped for memory
    processes: tuple[ProcessFigures, ...] = ()
    bypass_stops: int = 0  # counter: processes stopped for holding GPU memory without libcgpu
    # counter: processes stopped (or reported) for GPU time beyond the container's grants
    overuse_stops: int = 0
    audits: int = 0  # counter: quiet spans the scheduler imposed so the driver could tell


@dataclass(frozen=True)
class RowMoves:
    """How many moves a GPU's scheduler took by one row of its table."""

    row: str
    count: int


@dataclass(frozen=True)
class GpuFigures:
    """One GPU: identity from NVML, configuration from the tree, usage measured."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: int | None  # None when NVML cannot tell
    utilization: float | None  # ratio busy over the last seconds; None when unknown
    policy: int
    max_inst: int
    prio_ratio: int  # percent (the tree's node)
    free_weight: int
    # counters of its dispatcher: wake-ups, steps, and grants to a new holder
    dispatch_wakes: int = 0
    dispatch_steps: int = 0
    switches: int = 0
    # its wake-ups at a deadline, and how late they ran: summed and the most (s)
    dispatch_late_wakes: int = 0
    dispatch_late_seconds: float = 0.0
    dispatch_late_max_seconds: float = 0.0
    dispatch_scheduling: str = ""  # its thread's scheduling policy, in words
    # counters: the moves its scheduler took, by row of the table (rows not yet
    # taken left out)
    dispatch_moves: tuple[RowMoves, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    """Everything the daemon publishes at one instant."""

    version: str
    pid: int
    period_seconds: float
    timestamp: float  # Unix time the snapshot was taken
    started: float  # Unix time the daemon started
    gpus: tuple[GpuFigures, ...] = ()
    containers: tuple[ContainerFigures, ...] = ()

    def gpu(self, index: int) -> GpuFigures | None:
        return next((g for g in self.gpus if g.index == index), None)

    def container(self, gpu: int, name: str) -> ContainerFigures | None:
        return next((c for c in self.containers if c.gpu == gpu and c.name == name), None)

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.timestamp

    def is_fresh(self, now: float | None = None) -> bool:
        """Taken recently enough that its daemon is still publishing."""
        limit = max(FRESH_MIN_SECONDS, FRESH_PERIODS * self.period_seconds)
        return self.age(now) <= limit

    def to_dict(self) -> dict[str, Any]:
        plain = _plain(self)
        assert isinstance(plain, dict)
        return {"format": FORMAT, **plain}

    def to_json(self) -> str:
        # One line: json's C encoder (indent takes the pure-Python one, 2.5x slower).
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Snapshot:
        if not isinstance(data, Mapping):
            raise SnapshotError("snapshot: expected a JSON object")
        if data.get("format") != FORMAT:
            raise SnapshotError(f"snapshot: format {data.get('format')!r}, expected {FORMAT}")
        fields = {k: v for k, v in data.items() if k != "format"}
        snapshot: Snapshot = _load(cls, fields, "snapshot")
        return snapshot

    @classmethod
    def from_json(cls, text: str) -> Snapshot:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise SnapshotError(f"snapshot: not JSON: {error}") from None
        return cls.from_dict(data)


def _plain(value: Any) -> Any:
    """`dataclasses.asdict` for the snapshot's plain fields, without its deep copies."""
    kind = type(value)
    if kind in _SCALARS:  # most values: tested first, as the snapshot has thousands
        return value
    names = _field_names(kind)
    if names is not None:
        return {name: _plain(getattr(value, name)) for name in names}
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    return value


_SCALARS = frozenset({int, float, str, bool, type(None)})


_FIELD_NAMES: dict[type, tuple[str, ...] | None] = {}


def _field_names(kind: type) -> tuple[str, ...] | None:
    """The field names of a dataclass type, None for any other type (remembered)."""
    try:
        return _FIELD_NAMES[kind]
    except KeyError:
        names = (tuple(f.name for f in dataclasses.fields(kind))
                 if dataclasses.is_dataclass(kind) else None)
        _FIELD_NAMES[kind] = names
        return names


def _check(hint: Any, value: Any, where: str) -> Any:
    """`value` converted to the type `hint` says, or SnapshotError naming `where`."""
    origin = typing.get_origin(hint)
    if origin is types.UnionType or origin is typing.Union:
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [t for t in options if t is not type(None)]
        return _check(inner, value, where)
    if origin is tuple:
        (item, _ellipsis) = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            raise SnapshotError(f"{where}: expected a list")
        return tuple(_check(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise SnapshotError(f"{where}: expected an object")
        return _load(typing.cast(type[Any], hint), value, where)
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool):
        raise SnapshotError(f"{where}: expected an integer, got {value!r}")
    if isinstance(value, hint):
        return value
    raise SnapshotError(f"{where}: expected {hint.__name__}, got {value!r}")


_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _load(cls: type[Any], data: Mapping[str, Any], where: str) -> Any:
    hints = _hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(known)
    if unknown:
        raise SnapshotError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    values = {}
    for name, spec in known.items():
        if name not in data:
            if spec.default is dataclasses.MISSING:
                raise SnapshotError(f"{where}: missing field {name!r}")
            continue
        values[name] = _check(hints[name], data[name], f"{where}.{name}")
    return cls(**values)


def resolve_state_dir(state_dir: str | os.PathLike[str] | None = None) -> Path:
    """`--state-dir`, then `$CGPU_STATE_DIR`, else /run/cgpu_km-daemon."""
    if state_dir:
        return Path(state_dir)
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV])
    return DEFAULT_STATE_DIR


def snapshot_path(state_dir: str | os.PathLike[str] | None = None) -> Path:
    return resolve_state_dir(state_dir) / SNAPSHOT_NAME


def write_snapshot(snapshot: Snapshot, path: str | os.PathLike[str]) -> None:
    """Replace `path` atomically with `snapshot` (mode 0644: readable by cgpu-smi users)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    replace_file(target, snapshot.to_json(), 0o644)


def read_snapshot(path: str | os.PathLike[str]) -> Snapshot | None:
    """The snapshot in `path`; None when there is none; SnapshotError when it is malformed."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    return Snapshot.from_json(text)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True

