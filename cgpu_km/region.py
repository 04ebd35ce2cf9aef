"""The per-container shared-memory region between the daemon and libcgpu.

A ctypes mirror of `libcgpu/region.h` (a test compiles a probe against the
header and compares every offset and size), plus the daemon's operations on
it: create/open, limits, gates with futex wake-ups, the heartbeat, per-process
views and the reclaim of slots whose process is gone.

The container total on a GPU is the sum of the process slots: no separate
counter exists. The library's rules are described at the top of region.h.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = 0x314E4F4947455243  # "CREGION1"
VERSION = 2
MAX_GPUS = 16
MAX_PROCS = 256
ID_LEN = 72
PATH_LEN = 256
UUID_LEN = 96
DEFAULT_GATE_TIMEOUT_NS = 2_000_000_000
# Launches per stream a process may keep queued (about; 0 = unbounded): after
# the gate closes, the GPU runs at most this many more kernels per stream.
DEFAULT_MAX_INFLIGHT = 16
MAX_INFLIGHT_ENV = "CGPU_MAX_INFLIGHT"  # libcgpu: overrides the region's bound in a process

MODE_CGPU = 0
MODE_EGPU = 1
MODES = {"cgpu": MODE_CGPU, "egpu": MODE_EGPU}

GATE_OPEN = 0
GATE_CLOSED = 1

SLOT_FREE = 0
SLOT_CLAIMING = 1
SLOT_LIVE = 2
SLOT_RECLAIMING = 3

REGION_DIR_ENV = "CGPU_REGION_DIR"
DEFAULT_REGION_DIR = "/run/cgpu_km-regions"
REGION_ENV = "CGPU_REGION"
CONTAINER_REGION_PATH = "/run/cgpu/region"  # libcgpu's default when $CGPU_REGION is unset
CONTAINER_LIBRARY_PATH = "/usr/local/lib/cgpu/libcgpu.so"  # where the hook mounts the library
CTX_BYTES_ENV = "CGPU_CTX_BYTES"
SIMGPU_CONTEXT_MEM = 300 << 20  # simgpu's default context memory (SIMGPU_CONTEXT_MEM)


class GpuEntry(ctypes.Structure):
    _fields_ = (
        ("limit", ctypes.c_uint64),
        ("ctx_bytes", ctypes.c_uint64),
        ("gate", ctypes.c_uint32),
        ("host_index", ctypes.c_uint32),
        ("gate_changes", ctypes.c_uint64),
        ("uuid", ctypes.c_char * UUID_LEN),
        ("max_inflight", ctypes.c_uint32),
        ("reserved32", ctypes.c_uint32),
        ("reserved", ctypes.c_uint8 * 120),
    )


class ProcGpu(ctypes.Structure):
    _fields_ = (
        ("mem", ctypes.c_uint64),
        ("inflight", ctypes.c_uint64),
        ("launches", ctypes.c_uint64),
        ("last_launch_ns", ctypes.c_uint64),
        ("gate_wait_ns", ctypes.c_uint64),
        ("pending", ctypes.c_uint32),
        ("contexts", ctypes.c_uint32),
        ("allocs", ctypes.c_uint64),
        ("oom_refusals", ctypes.c_uint64),
    )


class ProcSlot(ctypes.Structure):
    _fields_ = (
        ("state", ctypes.c_uint32),
        ("pid", ctypes.c_int32),
        ("start_time", ctypes.c_uint64),
        ("pidns", ctypes.c_uint64),
        ("attach_ns", ctypes.c_uint64),
        ("comm", ctypes.c_char * 32),
        ("gpu", ProcGpu * MAX_GPUS),
    )


class RegionLayout(ctypes.Structure):
    _fields_ = (
        ("magic", ctypes.c_uint64),
        ("version", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("ngpus", ctypes.c_uint32),
        ("mode", ctypes.c_uint32),
        ("heartbeat_ns", ctypes.c_uint64),
        ("gate_timeout_ns", ctypes.c_uint64),
        ("slots_used", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("created_ns", ctypes.c_uint64),
        ("container_id", ctypes.c_char * ID_LEN),
        ("oom_script", ctypes.c_char * PATH_LEN),
        ("reserved", ctypes.c_uint8 * 128),
        ("gpu", GpuEntry * MAX_GPUS),
        ("proc", ProcSlot * MAX_PROCS),
    )


REGION_SIZE = ctypes.sizeof(RegionLayout)


class RegionError(Exception):
    """A region cannot be created or used; `str(error)` is the one-line message."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU of a container: its limit in bytes (0 = whole device), its
    UUID as NVML prints it ("" = match by ordinal), its host index, the
    bytes charged for each process's context on it, and how many launches
    per stream a process may keep queued (0 = unbounded)."""

    limit: int
    uuid: str = ""
    host_index: int = 0
    ctx_bytes: int = 0
    max_inflight: int = DEFAULT_MAX_INFLIGHT


@dataclass(frozen=True)
class ProcView:
    """A live process slot; per-GPU tuples are indexed by container GPU."""

    slot: int
    pid: int
    start_time: int
    pidns: int
    comm: str
    attach_ns: int
    mem: tuple[int, ...]
    launches: tuple[int, ...]
    last_launch_ns: tuple[int, ...]
    pending: tuple[int, ...]
    gate_wait_ns: tuple[int, ...]
    contexts: tuple[int, ...]
    oom_refusals: tuple[int, ...]


@dataclass(frozen=True)
class Activity:
    """Container-wide launch activity on one GPU, summed over live slots."""

    launches: int
    last_launch_ns: int
    pending: int
    gate_wait_ns: int


def region_dir() -> Path:
    """Where regions live: $CGPU_REGION_DIR, else /run/cgpu_km-regions."""
    return Path(os.environ.get(REGION_DIR_ENV) or DEFAULT_REGION_DIR)


def default_ctx_bytes(simulated: bool, env: Mapping[str, str] | None = None) -> int:
    """Bytes charged per process context: $CGPU_CTX_BYTES, else simgpu's
    context memory on the simulated GPU, else 0 (not charged)."""
    source = os.environ if env is None else env
    if source.get(CTX_BYTES_ENV):
        return int(source[CTX_BYTES_ENV])
    if simulated:
        return int(source.get("SIMGPU_CONTEXT_MEM") or SIMGPU_CONTEXT_MEM)
    return 0


def region_path(container: str, directory: Path | None = None) -> Path:
    """The region file of a container (named as in the control tree)."""
    return (directory or region_dir()) / f"{container}.region"


# ---- atomics and futex through libc / libatomic ----------------------------

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221}.get(platform.machine(), 202)
_FUTEX_WAKE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libatomic: Any = None


def _cas32(address: int, expected: int, desired: int) -> bool:
    """Compare-and-swap a 32-bit word shared with C code (libatomic)."""
    global _libatomic
    if _libatomic is None:
        try:
            _libatomic = ctypes.CDLL("libatomic.so.1")
        except OSError as error:
            raise RegionError(f"libatomic.so.1 is needed to reclaim slots: {error}") from None
        _libatomic.__atomic_compare_exchange_4.restype = ctypes.c_bool
        _libatomic.__atomic_compare_exchange_4.argtypes = (
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_int)
    want = ctypes.c_uint32(expected)
    seq_cst = 5
    return bool(_libatomic.__atomic_compare_exchange_4(
        address, ctypes.addressof(want), desired, seq_cst, seq_cst))


def _futex_wake_all(address: int) -> None:
    _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAKE),
                  ctypes.c_int(2**31 - 1), None, None, ctypes.c_int(0))


# ---- liveness --------------------------------------------------------------

def _own_pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat, or None when the process is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    rest = text[text.rindex(")") + 2:].split()
    if rest[0] in ("Z", "X"):
        return None
    return int(rest[19])


def local_alive(proc: ProcView) -> bool:
    """Whether a slot's process runs, judged in this process's pid namespace.

    A slot from another pid namespace counts as alive (its pid means nothing
    here); the daemon passes its own predicate for those."""
    own = _own_pidns()
    if proc.pidns and own and proc.pidns != own:
        return True
    try:
        start = proc_start_time(proc.pid)
    except (OSError, ValueError, IndexError):
        try:
            os.kill(proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return start is not None and (proc.start_time == 0 or start == proc.start_time)


def _nspid(pid: str) -> int | None:
    """The pid of a process in its own (innermost) pid namespace."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return None


def host_liveness(proc_root: str = "/proc") -> Callable[[ProcView], bool]:
    """A predicate for `Region.reclaim` that sees into every pid namespace.

    One scan of /proc (the daemon runs on the host): a slot is alive when a
    running process has its pid-namespace inode, its pid in that namespace
    and its start time. Slots without a namespace inode fall back to
    `local_alive`."""
    running: set[tuple[int, int, int]] = set()
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit():
            continue
        try:
            pidns = os.stat(f"{proc_root}/{entry.name}/ns/pid").st_ino
            inner = _nspid(entry.name)
            start = proc_start_time(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
        if inner is not None and start is not None:
            running.add((pidns, inner, start))
    by_pid = {(ns, pid) for ns, pid, _ in running}

    def alive(view: ProcView) -> bool:
        if view.pidns == 0:
            return local_alive(view)
        if view.start_time == 0:
            return (view.pidns, view.pid) in by_pid
        return (view.pidns, view.pid, view.start_time) in running

    return alive


# ---- the region ------------------------------------------------------------

def _check_max_inflight(launches: int, where: str = "") -> None:
    if not 0 <= launches < 2**30:
        raise RegionError(f"{where}max_inflight must be 0 (unbounded) to {2**30 - 1}, "
                          f"not {launches}")


def _encode(text: str, size: int, what: str) -> bytes:
    data = text.encode()
    if len(data) >= size:
        raise RegionError(f"{what} is longer than {size - 1} bytes: {text!r}")
    return data


class Region:
    """An open, mapped region. Use `Region.create` or `Region.open`."""

    def __init__(self, path: Path, mapping: mmap.mmap) -> None:
        self.path = path
        self._map = mapping
        self._layout = RegionLayout.from_buffer(mapping)

    # -- lifecycle --

    @classmethod
    def create(cls, path: str | os.PathLike[str], container_id: str, gpus: Sequence[GpuSpec],
               *, mode: str = "cgpu", oom_script: str = "",
               gate_timeout_ns: int = DEFAULT_GATE_TIMEOUT_NS) -> Region:
        """Write a fresh region atomically (temp file + rename) and map it.

        The file is world-writable: a container's processes may run as any
        user, and only that container gets the file."""
        target = Path(path)
        if not 1 <= len(gpus) <= MAX_GPUS:
            raise RegionError(f"a region holds 1 to {MAX_GPUS} GPUs, not {len(gpus)}")
        if mode not in MODES:
            raise RegionError(f"mode must be cgpu or egpu, not {mode!r}")
        if gate_timeout_ns <= 0:
            raise RegionError("gate_timeout_ns must be positive")
        layout = RegionLayout()
        layout.magic = MAGIC
        layout.version = VERSION
        layout.size = REGION_SIZE
        layout.ngpus = len(gpus)
        layout.mode = MODES[mode]
        layout.gate_timeout_ns = gate_timeout_ns
        layout.created_ns = time.monotonic_ns()
        layout.container_id = _encode(container_id, ID_LEN, "container id")
        layout.oom_script = _encode(oom_script, PATH_LEN, "OOM script path")
        for k, spec in enumerate(gpus):
            if spec.limit < 0 or spec.ctx_bytes < 0:
                raise RegionError(f"GPU {k}: limit and ctx_bytes must not be negative")
            _check_max_inflight(spec.max_inflight, f"GPU {k}: ")
            entry = layout.gpu[k]
            entry.limit = spec.limit
            entry.ctx_bytes = spec.ctx_bytes
            entry.host_index = spec.host_index
            entry.max_inflight = spec.max_inflight
            entry.gate = GATE_OPEN
            entry.uuid = _encode(spec.uuid, UUID_LEN, "GPU UUID")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(bytes(layout))
                os.fchmod(handle.fileno(), 0o666)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return cls.open(target)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Region:
        """Map an existing region, checking magic, version and size."""
        target = Path(path)
        try:
            fd = os.open(target, os.O_RDWR | os.O_CLOEXEC)
        except OSError as error:
            raise RegionError(f"cannot open region {target}: {error.strerror}") from None
        try:
            if os.fstat(fd).st_size < REGION_SIZE:
                raise RegionError(f"region {target} is too small for layout version {VERSION}")
            mapping = mmap.mmap(fd, REGION_SIZE, mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        header = RegionLayout.from_buffer_copy(mapping[:64] + bytes(REGION_SIZE - 64))
        if header.magic != MAGIC or header.version != VERSION or header.size != REGION_SIZE:
            mapping.close()
            raise RegionError(f"region {target} has an unknown layout "
                              f"(version {header.version}, want {VERSION})")
        return cls(target, mapping)

    def close(self) -> None:
        del self._layout
        self._map.close()

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def remove(path: str | os.PathLike[str]) -> None:
        """Delete a region file; a missing file is fine."""
        Path(path).unlink(missing_ok=True)

    # -- header --

    @property
    def container_id(self) -> str:
        return bytes(self._layout.container_id).decode(errors="replace")

    @property
    def mode(self) -> str:
        return "egpu" if self._layout.mode == MODE_EGPU else "cgpu"

    @property
    def oom_script(self) -> str:
        return bytes(self._layout.oom_script).decode(errors="replace")

    @property
    def ngpus(self) -> int:
        return int(self._layout.ngpus)

    @property
    def gate_timeout_ns(self) -> int:
        return int(self._layout.gate_timeout_ns)

    @gate_timeout_ns.setter
    def gate_timeout_ns(self, value: int) -> None:
        if value <= 0:
            raise RegionError("gate_timeout_ns must be positive")
        self._layout.gate_timeout_ns = value

    @property
    def heartbeat_ns(self) -> int:
        return int(self._layout.heartbeat_ns)

    def heartbeat(self, now_ns: int | None = None) -> None:
        """Stamp the daemon's heartbeat (CLOCK_MONOTONIC); gates hold only while it is fresh."""
        self._layout.heartbeat_ns = time.monotonic_ns() if now_ns is None else now_ns

    def clear_heartbeat(self) -> None:
        """Say the daemon is gone: every closed gate fails open at once."""
        self._layout.heartbeat_ns = 0
        for k in range(self.ngpus):
            _futex_wake_all(self._gate_address(k))

    # -- per GPU --

    def _gpu(self, k: int) -> GpuEntry:
        if not 0 <= k < self.ngpus:
            raise RegionError(f"GPU {k} is not in region {self.path} ({self.ngpus} GPUs)")
        return self._layout.gpu[k]  # type: ignore[no-any-return]

    def gpu_spec(self, k: int) -> GpuSpec:
        entry = self._gpu(k)
        return GpuSpec(int(entry.limit), bytes(entry.uuid).decode(), int(entry.host_index),
                       int(entry.ctx_bytes), int(entry.max_inflight))

    def gpu_for_host(self, host_index: int) -> int | None:
        """The container GPU that is host GPU `host_index`, if any."""
        for k in range(self.ngpus):
            if self._layout.gpu[k].host_index == host_index:
                return k
        return None

    def limit(self, k: int) -> int:
        return int(self._gpu(k).limit)

    def set_limit(self, k: int, limit: int) -> None:
        """New limit in bytes (0 = whole device). Existing allocations stay."""
        if limit < 0:
            raise RegionError("limit must not be negative")
        self._gpu(k).limit = limit

    def set_ctx_bytes(self, k: int, ctx_bytes: int) -> None:
        if ctx_bytes < 0:
            raise RegionError("ctx_bytes must not be negative")
        self._gpu(k).ctx_bytes = ctx_bytes

    def set_max_inflight(self, k: int, launches: int) -> None:
        """New in-flight bound of GPU k (0 = unbounded); processes apply it at their next launch."""
        _check_max_inflight(launches)
        self._gpu(k).max_inflight = launches

    def _gate_address(self, k: int) -> int:
        return ctypes.addressof(self._gpu(k)) + GpuEntry.gate.offset

    def gate_is_open(self, k: int) -> bool:
        return bool(self._gpu(k).gate == GATE_OPEN)

    def set_gate(self, k: int, is_open: bool) -> None:
        """Open or close the gate of container GPU k; opening wakes every waiter."""
        entry = self._gpu(k)
        value = GATE_OPEN if is_open else GATE_CLOSED
        if entry.gate != value:
            entry.gate = value
            entry.gate_changes += 1
        if is_open:
            _futex_wake_all(self._gate_address(k))

    # -- processes --

    def _slots_used(self) -> int:
        return min(int(self._layout.slots_used), MAX_PROCS)

    def processes(self) -> list[ProcView]:
        """Every slot in state LIVE, dead or alive (see `reclaim`)."""
        views = []
        n = self.ngpus
        for i in range(self._slots_used()):
            slot = self._layout.proc[i]
            if slot.state != SLOT_LIVE:
                continue
            per = [slot.gpu[k] for k in range(n)]
            views.append(ProcView(
                slot=i, pid=int(slot.pid), start_time=int(slot.start_time),
                pidns=int(slot.pidns), comm=bytes(slot.comm).decode(errors="replace"),
                attach_ns=int(slot.attach_ns),
                mem=tuple(int(p.mem) for p in per),
                launches=tuple(int(p.launches) for p in per),
                last_launch_ns=tuple(int(p.last_launch_ns) for p in per),
                pending=tuple(int(p.pending) for p in per),
                gate_wait_ns=tuple(int(p.gate_wait_ns) for p in per),
                contexts=tuple(int(p.contexts) for p in per),
                oom_refusals=tuple(int(p.oom_refusals) for p in per),
            ))
        return views

    def usage(self, k: int) -> int:
        """Bytes the container holds on GPU k: the sum of all slots."""
        self._gpu(k)
        return sum(int(self._layout.proc[i].gpu[k].mem) for i in range(self._slots_used()))

    def activity(self, k: int) -> Activity:
        """Launch counters of GPU k summed over live slots (compare between ticks)."""
        self._gpu(k)
        procs = self.processes()
        return Activity(
            launches=sum(p.launches[k] for p in procs),
            last_launch_ns=max((p.last_launch_ns[k] for p in procs), default=0),
            pending=sum(p.pending[k] for p in procs),
            gate_wait_ns=sum(p.gate_wait_ns[k] for p in procs),
        )

    def reclaim(self, is_alive: Callable[[ProcView], bool] = local_alive) -> list[int]:
        """Zero the slots whose process `is_alive` says is gone; returns their pids.

        Safe against libcgpu doing the same at the same time (compare-and-swap
        on the slot state, then zeroing, which is idempotent)."""
        reclaimed = []
        for view in self.processes():
            if is_alive(view):
                continue
            slot = self._layout.proc[view.slot]
            address = ctypes.addressof(slot) + ProcSlot.state.offset
            if not _cas32(address, SLOT_LIVE, SLOT_RECLAIMING):
                continue
            if slot.pid != view.pid or slot.start_time != view.start_time:
                slot.state = SLOT_LIVE  # reclaimed and claimed again since we looked
                continue
            ctypes.memset(ctypes.addressof(slot.gpu), 0, ctypes.sizeof(slot.gpu))
            slot.pid = 0
            slot.state = SLOT_FREE
            reclaimed.append(view.pid)
        return reclaimed

