"""The per-container shared memory between the daemon and libcgpu.

A ctypes mirror of `libcgpu/region.h` (a test compiles a probe against the
header and compares every offset and size), plus the operations on it of
whoever creates a region (the OCI hook, `cgpu-run`) and of the daemon.

A region is a directory of two files, in a folder only root can enter:

- `control`: what the daemon decides (limits, gates, heartbeat, mode, OOM
  script). Mode 0644; the hook bind-mounts it read-only into the container.
- `account`: what the container's processes report, one slot each. Mode
  0666 (a container's processes may run as any user); only the container
  gets it, through a bind mount.

The container total on a GPU is the sum of the process slots: no separate
counter exists. The library's rules are described at the top of region.h.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgpu_km.dataplane import futex

CONTROL_MAGIC = 0x344C544355504743  # "CGPUCTL4"
ACCOUNT_MAGIC = 0x3454434155504743  # "CGPUACT4"
VERSION = 4
MAX_GPUS = 16
MAX_PROCS = 256
MAX_SEEN = 256  # processes the daemon lists in control.seen
SEEN_MAX_AGE_NS = 5_000_000_000  # libcgpu does not believe an older publication
ID_LEN = 72
PATH_LEN = 256
UUID_LEN = 96
DEFAULT_GATE_TIMEOUT_NS = 2_000_000_000
# Launches per stream a process may keep queued (about; 0 = unbounded): after
# the gate closes, the GPU runs at most this many more kernels per stream.
DEFAULT_MAX_INFLIGHT = 16
# gpu.queue_ns: the GPU time a process may keep queued, all streams together
# (0: DEFAULT_QUEUE_NS); the dispatcher writes CONTENDED_QUEUE_NS while another
# container waits for the GPU.
DEFAULT_QUEUE_NS = 4_000_000
CONTENDED_QUEUE_NS = 1_000_000
MAX_INFLIGHT_ENV = "CGPU_MAX_INFLIGHT"  # libcgpu: overrides the region's bound in a process
CTX_MEASURE = 2**64 - 1  # ctx_bytes: libcgpu measures each context as it is made

MODE_CGPU = 0
MODE_EGPU = 1
MODES = {"cgpu": MODE_CGPU, "egpu": MODE_EGPU}

GATE_OPEN = 0
GATE_CLOSED = 1
GATE_ARMED = 2  # closed, but a launch passes and rings (region.h)

SLOT_FREE = 0
SLOT_CLAIMING = 1
SLOT_LIVE = 2
SLOT_RECLAIMING = 3

REGION_DIR_ENV = "CGPU_REGION_DIR"
DEFAULT_REGION_DIR = "/run/cgpu_km-regions"
REGION_ENV = "CGPU_REGION"
CONTAINER_REGION_DIR = "/run/cgpu"  # where the hook mounts a container's two files
CONTROL_NAME = "control"
ACCOUNT_NAME = "account"
CONTAINER_LIBRARY_PATH = "/usr/local/lib/cgpu/libcgpu.so"  # where the hook mounts the library
CTX_BYTES_ENV = "CGPU_CTX_BYTES"


class GpuEntry(ctypes.Structure):
    _fields_ = (
        ("limit", ctypes.c_uint64),
        ("ctx_bytes", ctypes.c_uint64),
        ("gate", ctypes.c_uint32),
        ("host_index", ctypes.c_uint32),
        ("gate_changes", ctypes.c_uint64),
        ("close_seq", ctypes.c_uint64),
        ("grant_ns", ctypes.c_uint64),
        ("uuid", ctypes.c_char * UUID_LEN),
        ("max_inflight", ctypes.c_uint32),
        ("reserved32", ctypes.c_uint32),
        ("queue_ns", ctypes.c_uint64),
        ("idle_grace_ns", ctypes.c_uint64),
        ("close_at_ns", ctypes.c_uint64),
        ("reserved", ctypes.c_uint8 * 80),
    )


class SeenEntry(ctypes.Structure):
    _fields_ = (
        ("pidns", ctypes.c_uint64),
        ("pid", ctypes.c_int32),
        ("gpu", ctypes.c_uint32),
        ("start_time", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
    )


class ControlLayout(ctypes.Structure):
    _fields_ = (
        ("magic", ctypes.c_uint64),
        ("version", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("ngpus", ctypes.c_uint32),
        ("mode", ctypes.c_uint32),
        ("heartbeat_ns", ctypes.c_uint64),
        ("gate_timeout_ns", ctypes.c_uint64),
        ("wake", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("created_ns", ctypes.c_uint64),
        ("container_id", ctypes.c_char * ID_LEN),
        ("oom_script", ctypes.c_char * PATH_LEN),
        ("reserved", ctypes.c_uint8 * 128),
        ("gpu", GpuEntry * MAX_GPUS),
        ("seen_seq", ctypes.c_uint64),
        ("seen_rounds", ctypes.c_uint64),
        ("seen_ns", ctypes.c_uint64),
        ("nseen", ctypes.c_uint32),
        ("seen_reserved", ctypes.c_uint32),
        ("seen_rest", ctypes.c_uint64 * MAX_GPUS),
        ("seen", SeenEntry * MAX_SEEN),
    )


class ProcGpu(ctypes.Structure):
    _fields_ = (
        ("mem", ctypes.c_uint64),
        ("inflight", ctypes.c_uint64),
        ("launches", ctypes.c_uint64),
        ("hijacked", ctypes.c_uint64),
        ("gate_wait_ns", ctypes.c_uint64),
        ("pending", ctypes.c_uint32),
        ("contexts", ctypes.c_uint32),
        ("allocs", ctypes.c_uint64),
        ("oom_refusals", ctypes.c_uint64),
        ("ctx_bytes", ctypes.c_uint64),
        ("drained_seq", ctypes.c_uint64),
        ("drained_ns", ctypes.c_uint64),
        ("watching", ctypes.c_uint32),
        ("closes_itself", ctypes.c_uint32),
        ("stale_heartbeat_ns", ctypes.c_uint64),
        ("gate_wake_ns", ctypes.c_uint64),
        ("failed_open_ns", ctypes.c_uint64),
        ("idle_ns", ctypes.c_uint64),
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


class AccountLayout(ctypes.Structure):
    _fields_ = (
        ("magic", ctypes.c_uint64),
        ("version", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("slots_used", ctypes.c_uint32),
        ("reserved32", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 5),
        ("doorbell", ctypes.c_uint32 * MAX_GPUS),
        ("proc", ProcSlot * MAX_PROCS),
    )


CONTROL_SIZE = ctypes.sizeof(ControlLayout)
ACCOUNT_SIZE = ctypes.sizeof(AccountLayout)


class RegionError(Exception):
    """A region cannot be created or used; `str(error)` is the one-line message."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU of a container: its limit in bytes (0 = whole device), its
    UUID as NVML prints it ("" = match by ordinal), its host index, the
    bytes charged for each process's context on it (CTX_MEASURE: measured
    by libcgpu as each context is made), and how many launches per stream a
    process may keep queued (0 = unbounded)."""

    limit: int
    uuid: str = ""
    host_index: int = 0
    ctx_bytes: int = CTX_MEASURE
    max_inflight: int = DEFAULT_MAX_INFLIGHT


@dataclass(frozen=True)
class Seen:
    """One GPU process of the container as the daemon saw it (the kernel's
    identity, NVML's bytes) on container GPU `gpu`."""

    gpu: int
    pidns: int
    pid: int
    start_time: int
    bytes: int


@dataclass(frozen=True)
class ProcView:
    """A live process slot as its process wrote it (untrusted); per-GPU tuples
    are indexed by container GPU. `hijacked`: how many of libcgpu's entry
    points other code in the process defines ahead of it (libcgpu's
    self-check; 0: none), so that calls by those names may bypass it."""

    slot: int
    pid: int
    start_time: int
    pidns: int
    comm: str
    attach_ns: int
    mem: tuple[int, ...]
    launches: tuple[int, ...]
    pending: tuple[int, ...]
    gate_wait_ns: tuple[int, ...]
    contexts: tuple[int, ...]
    oom_refusals: tuple[int, ...]
    ctx_bytes: tuple[int, ...] = ()
    hijacked: int = 0


@dataclass(frozen=True)
class Activity:
    """Container-wide launch activity on one GPU, summed over live slots."""

    launches: int
    pending: int
    gate_wait_ns: int


@dataclass(frozen=True)
class FailedOpen:
    """A launch that waited at a closed gate until the daemon's heartbeat was
    stale, then went on, as its process recorded it: the heartbeat it judged
    stale (0: no daemon), when its last timed wait was to end, and when it went
    on (CLOCK_MONOTONIC nanoseconds)."""

    heartbeat_ns: int
    wake_ns: int
    at_ns: int

    @property
    def age_ns(self) -> int:
        """How old the heartbeat was when the launch went on."""
        return self.at_ns - self.heartbeat_ns


@dataclass(frozen=True)
class SlotFigures:
    """The live slots of a region on one GPU, as a memory round reads them: the
    nanoseconds their launches waited at the gate, their allocations refused
    for memory (the figures `processes` sums), and who they are."""

    gate_wait_ns: int = 0
    oom_refusals: int = 0
    identities: frozenset[tuple[int, int, int]] = frozenset()  # (pid namespace, pid, start)


NO_SLOTS = SlotFigures()


def region_dir() -> Path:
    """Where regions live: $CGPU_REGION_DIR, else /run/cgpu_km-regions."""
    return Path(os.environ.get(REGION_DIR_ENV) or DEFAULT_REGION_DIR)


def default_ctx_bytes(env: dict[str, str] | None = None) -> int:
    """Bytes charged per process context: $CGPU_CTX_BYTES, else measured by libcgpu."""
    source = os.environ if env is None else env
    text = source.get(CTX_BYTES_ENV, "")
    if not text:
        return CTX_MEASURE
    try:
        value = int(text)
    except ValueError:
        raise RegionError(f"{CTX_BYTES_ENV}={text!r} is not a number of bytes") from None
    if value < 0:
        raise RegionError(f"{CTX_BYTES_ENV}={text!r} must not be negative")
    return value


def region_path(container: str, directory: Path | None = None) -> Path:
    """The region (a directory) of a container, named as in the control tree."""
    return (directory or region_dir()) / container


# ---- atomics through libatomic ---------------------------------------------

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


def _check_max_inflight(launches: int, where: str = "") -> None:
    if not 0 <= launches < 2**30:
        raise RegionError(f"{where}max_inflight must be 0 (unbounded) to {2**30 - 1}, "
                          f"not {launches}")


def _encode(text: str, size: int, what: str) -> bytes:
    data = text.encode()
    if len(data) >= size:
        raise RegionError(f"{what} is longer than {size - 1} bytes: {text!r}")
    return data


def _control_layout(container_id: str, gpus: Sequence[GpuSpec], mode: str, oom_script: str,
                    gate_timeout_ns: int, gates_open: bool) -> ControlLayout:
    if not 1 <= len(gpus) <= MAX_GPUS:
        raise RegionError(f"a region holds 1 to {MAX_GPUS} GPUs, not {len(gpus)}")
    if mode not in MODES:
        raise RegionError(f"mode must be cgpu or egpu, not {mode!r}")
    if gate_timeout_ns <= 0:
        raise RegionError("gate_timeout_ns must be positive")
    layout = ControlLayout()
    layout.magic = CONTROL_MAGIC
    layout.version = VERSION
    layout.size = CONTROL_SIZE
    layout.ngpus = len(gpus)
    layout.mode = MODES[mode]
    layout.gate_timeout_ns = gate_timeout_ns
    layout.created_ns = time.monotonic_ns()
    # Gates start closed and held (a fresh heartbeat) until the daemon grants
    # the first slice; without a daemon they fail open after the timeout.
    layout.heartbeat_ns = 0 if gates_open else layout.created_ns
    layout.container_id = _encode(container_id, ID_LEN, "container id")
    layout.oom_script = _encode(oom_script, PATH_LEN, "OOM script path")
    for k, spec in enumerate(gpus):
        if spec.limit < 0 or not 0 <= spec.ctx_bytes <= CTX_MEASURE:
            raise RegionError(f"GPU {k}: limit and ctx_bytes must not be negative")
        _check_max_inflight(spec.max_inflight, f"GPU {k}: ")
        entry = layout.gpu[k]
        entry.limit = spec.limit
        entry.ctx_bytes = spec.ctx_bytes
        entry.host_index = spec.host_index
        entry.max_inflight = spec.max_inflight
        entry.gate = GATE_OPEN if gates_open else GATE_CLOSED
        entry.uuid = _encode(spec.uuid, UUID_LEN, "GPU UUID")
    return layout


def _account_layout() -> AccountLayout:
    layout = AccountLayout()
    layout.magic = ACCOUNT_MAGIC
    layout.version = VERSION
    layout.size = ACCOUNT_SIZE
    return layout


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        os.fchmod(handle.fileno(), mode)


def _map(path: Path, size: int, what: str) -> mmap.mmap:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as error:
        raise RegionError(f"cannot open {what} {path}: {error.strerror}") from None
    try:
        if os.fstat(fd).st_size < size:
            raise RegionError(f"{what} {path} is too small for layout version {VERSION}")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class Region:
    """An open, mapped region. Use `Region.create` or `Region.open`."""

    def __init__(self, path: Path, control: mmap.mmap, account: mmap.mmap) -> None:
        self.path = path
        self._control_map = control
        self._account_map = account
        self._control = ControlLayout.from_buffer(control)
        self._account = AccountLayout.from_buffer(account)
        self._published: tuple[Seen, ...] | None = None  # the last publish_seen's list
        # Read once: the daemon's dispatchers look at these for every container at
        # every step. The GPU count is the daemon's (the container's mount of the
        # control part is read-only); the doorbells stay where they are.
        self._ngpus = int(self._control.ngpus)
        self._doorbells = self._account.doorbell

    # -- lifecycle --

    @classmethod
    def create(cls, path: str | os.PathLike[str], container_id: str, gpus: Sequence[GpuSpec],
               *, mode: str = "cgpu", oom_script: str = "",
               gate_timeout_ns: int = DEFAULT_GATE_TIMEOUT_NS,
               gates_open: bool = False) -> Region:
        """Write a fresh region directory atomically (a temporary directory,
        then a rename) and map it. A region already at `path` is replaced.

        Gates start closed with a fresh heartbeat: the container's first launch
        waits for the daemon's first grant (or the gate timeout, without a
        daemon). `gates_open` starts them open and without a heartbeat, for
        jobs that no daemon schedules."""
        target = Path(path)
        control = _control_layout(container_id, gpus, mode, oom_script, gate_timeout_ns,
                                  gates_open)
        parent = target.parent
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # jobs start side by side
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=parent))
        try:
            os.chmod(staging, 0o700)
            _write(staging / CONTROL_NAME, bytes(control), 0o644)
            _write(staging / ACCOUNT_NAME, bytes(_account_layout()), 0o666)
            if target.exists():
                cls.remove(target)
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return cls.open(target)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Region:
        """Map an existing region, checking magic, version and size of both parts."""
        target = Path(path)
        control = _map(target / CONTROL_NAME, CONTROL_SIZE, "region control")
        try:
            account = _map(target / ACCOUNT_NAME, ACCOUNT_SIZE, "region account")
        except RegionError:
            control.close()
            raise
        for part, magic, size in ((control, CONTROL_MAGIC, CONTROL_SIZE),
                                  (account, ACCOUNT_MAGIC, ACCOUNT_SIZE)):
            head = bytes(part[:16])
            found = (int.from_bytes(head[:8], "little"), int.from_bytes(head[8:12], "little"),
                     int.from_bytes(head[12:16], "little"))
            if found != (magic, VERSION, size):
                control.close()
                account.close()
                raise RegionError(f"region {target} has an unknown layout "
                                  f"(version {found[1]}, want {VERSION})")
        return cls(target, control, account)

    def close(self) -> None:
        """Unmap now, unless views into the mapping are still held: then the
        mapping goes when the last of them does."""
        del self._control, self._account, self._doorbells
        for mapping in (self._control_map, self._account_map):
            with contextlib.suppress(BufferError):
                mapping.close()

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def remove(path: str | os.PathLike[str]) -> None:
        """Delete a region directory; a missing one is fine."""
        shutil.rmtree(path, ignore_errors=True)

    def identity(self) -> tuple[int, int]:
        """(device, inode) of the control file: a replaced region is a new one."""
        info = os.stat(self.path / CONTROL_NAME)
        return info.st_dev, info.st_ino

    # -- header --

    @property
    def container_id(self) -> str:
        return bytes(self._control.container_id).decode(errors="replace")

    @property
    def mode(self) -> str:
        return "egpu" if self._control.mode == MODE_EGPU else "cgpu"

    @property
    def oom_script(self) -> str:
        return bytes(self._control.oom_script).decode(errors="replace")

    @property
    def ngpus(self) -> int:
        return self._ngpus

    @property
    def gate_timeout_ns(self) -> int:
        return int(self._control.gate_timeout_ns)

    @property
    def heartbeat_ns(self) -> int:
        return int(self._control.heartbeat_ns)

    def heartbeat(self, now_ns: int | None = None) -> None:
        """Stamp the daemon's heartbeat (CLOCK_MONOTONIC); gates hold only while it is fresh."""
        self._control.heartbeat_ns = time.monotonic_ns() if now_ns is None else now_ns

    # -- per GPU --

    def _gpu(self, k: int) -> GpuEntry:
        if not 0 <= k < self._ngpus:
            raise RegionError(f"GPU {k} is not in region {self.path} ({self._ngpus} GPUs)")
        return self._control.gpu[k]  # type: ignore[no-any-return]

    def gpu_spec(self, k: int) -> GpuSpec:
        entry = self._gpu(k)
        return GpuSpec(int(entry.limit), bytes(entry.uuid).decode(), int(entry.host_index),
                       int(entry.ctx_bytes), int(entry.max_inflight))

    def gpu_for_host(self, host_index: int) -> int | None:
        """The container GPU that is host GPU `host_index`, if any."""
        for k in range(self.ngpus):
            if self._control.gpu[k].host_index == host_index:
                return k
        return None

    def limit(self, k: int) -> int:
        return int(self._gpu(k).limit)

    def set_limit(self, k: int, limit: int) -> None:
        """New limit in bytes (0 = whole device): new allocations beyond it fail;
        what processes hold already stays."""
        if limit < 0:
            raise RegionError("limit must not be negative")
        self._gpu(k).limit = limit

    def _gate_address(self, k: int) -> int:
        return ctypes.addressof(self._gpu(k)) + GpuEntry.gate.offset

    def _gate_changes_address(self, k: int) -> int:
        """The futex word libcgpu's gate waiters sleep on: the low half of
        gate_changes (little-endian)."""
        return ctypes.addressof(self._gpu(k)) + GpuEntry.gate_changes.offset

    def gate_is_open(self, k: int) -> bool:
        return bool(self._gpu(k).gate == GATE_OPEN)

    def gate(self, k: int) -> int:
        """GPU k's gate: GATE_OPEN, GATE_CLOSED or GATE_ARMED."""
        return int(self._gpu(k).gate)

    def close_seq(self, k: int) -> int:
        return int(self._gpu(k).close_seq)

    def grant_ns(self, k: int) -> int:
        return int(self._gpu(k).grant_ns)

    def queue_ns(self, k: int) -> int:
        """The GPU time each process may keep queued on GPU k (0: DEFAULT_QUEUE_NS)."""
        return int(self._gpu(k).queue_ns)

    def set_queue_ns(self, k: int, budget_ns: int) -> None:
        """Set that budget (libcgpu holds launches beyond it; 0: the default)."""
        if not 0 <= budget_ns < 2**64:
            raise RegionError(f"queue_ns must be 0 to 2**64 - 1, not {budget_ns}")
        self._gpu(k).queue_ns = budget_ns

    def set_idle_grace(self, k: int, grace_ns: int) -> None:
        """Ask the processes of container GPU k to say when they go idle for
        `grace_ns` (in their slots' `idle_ns`, with a ring) while its gate is
        open; 0: stop asking. Asking wakes their watchers (at once while the
        gate is open, else when it opens)."""
        entry = self._gpu(k)
        was = entry.idle_grace_ns
        if was == grace_ns:
            return
        entry.idle_grace_ns = grace_ns
        if grace_ns and not was and entry.gate == GATE_OPEN:
            self._wake_watchers()

    def close_at_ns(self, k: int) -> int:
        return int(self._gpu(k).close_at_ns)

    def set_close_at(self, k: int, at_ns: int) -> None:
        """Name when the slice of container GPU k's open gate ends (0: when the
        gate closes): processes that close themselves stop launching then and
        answer the close ahead. Naming a time wakes their watchers (at once
        while the gate is open, else when it opens). Written before the gate
        opens; an end that has come is never moved while the gate stays open
        (those processes answered for it: close the gate first)."""
        if not 0 <= at_ns < 2**64:
            raise RegionError(f"close_at_ns must be 0 to 2**64 - 1, not {at_ns}")
        entry = self._gpu(k)
        if entry.close_at_ns == at_ns:
            return
        entry.close_at_ns = at_ns
        if at_ns and entry.gate == GATE_OPEN:
            self._wake_watchers()

    def set_gate(self, k: int, is_open: bool, now_ns: int = 0, *, armed: bool = False) -> None:
        """Open the gate of container GPU k (a grant: waiters wake), arm it (a
        launch passes and rings: waiters wake), or close it.

        A close that changes the gate (from open, or from armed, through which
        processes may have launched) bumps `close_seq` and wakes the
        processes' watchers, which answer once their queued work drained."""
        entry = self._gpu(k)
        value = GATE_OPEN if is_open else GATE_ARMED if armed else GATE_CLOSED
        was = entry.gate
        if was == value:
            return
        entry.gate = value
        entry.gate_changes += 1
        if value != GATE_CLOSED:
            if is_open:
                entry.grant_ns = now_ns or time.monotonic_ns()
            # libcgpu sleeps on the count's low half (a gate that opened and closed
            # again is no lost grant); on the gate itself before that change.
            futex.wake_all(self._gate_changes_address(k))
            futex.wake_all(self._gate_address(k))
        if not is_open:
            entry.grant_ns = 0
        if value == GATE_CLOSED or was == GATE_OPEN:
            entry.close_seq += 1
            self._wake_watchers()
        elif is_open and (entry.idle_grace_ns or entry.close_at_ns):
            # Asked to watch, or told the slice's end, before the grant (as the
            # dispatcher does): its process's launches do not wake the watcher,
            # so the open must.
            self._wake_watchers()

    def _wake_watchers(self) -> None:
        """Wake libcgpu's watcher thread in every process of the container."""
        self._control.wake = (self._control.wake + 1) & 0xFFFFFFFF
        futex.wake_all(ctypes.addressof(self._control) + ControlLayout.wake.offset)

    def doorbell_address(self, k: int) -> int:
        """The futex word processes ring when they wait at GPU k's gate or answer a close."""
        self._gpu(k)
        return ctypes.addressof(self._account) + AccountLayout.doorbell.offset + 4 * k

    def doorbell(self, k: int) -> int:
        return int(self._doorbells[k])

    def quick_look(self) -> tuple[ctypes.Array[ctypes.c_uint32], AccountLayout]:
        """The doorbells and the account part as ctypes views: a dispatcher reads
        every container's doorbell and `slots_used` at every step, fields
        without a call each (`slots_used` as the processes wrote it: any
        value; `live_slots` bounds it)."""
        return self._doorbells, self._account

    # -- what the daemon saw --

    def publish_seen(self, seen: Sequence[Seen], now_ns: int | None = None) -> None:
        """Publish what the container's processes hold as the kernel's view saw
        it (libcgpu admits an allocation only if this leaves room too, for
        SEEN_MAX_AGE_NS). Under the seqlock `seen_seq`; one writer (the
        daemon's memory service). Nothing again is not published again: libcgpu
        reads an empty view without its time, so it never goes stale."""
        control = self._control
        valid = tuple(item for item in seen if 0 <= item.gpu < MAX_GPUS)
        if not valid and self._published == ():
            return
        control.seen_seq += 1  # odd: readers retry
        if valid != self._published:  # else only the time is new (most rounds)
            rest = [0] * MAX_GPUS
            for item in valid[MAX_SEEN:]:
                rest[item.gpu] += item.bytes
            for entry, item in zip(control.seen, valid[:MAX_SEEN], strict=False):
                entry.pidns, entry.pid, entry.gpu = item.pidns, item.pid, item.gpu
                entry.start_time, entry.bytes = item.start_time, item.bytes
            control.nseen = min(len(valid), MAX_SEEN)
            for k in range(MAX_GPUS):
                control.seen_rest[k] = rest[k]
            self._published = valid
        control.seen_ns = time.monotonic_ns() if now_ns is None else now_ns
        control.seen_seq += 1
        control.seen_rounds += 1

    @property
    def seen_rounds(self) -> int:
        """How many times the daemon published what it saw."""
        return int(self._control.seen_rounds)

    def seen_total(self, k: int) -> int:
        """Bytes the daemon saw the container hold on container GPU k."""
        return sum(e.bytes for e in self.seen() if e.gpu == k) + int(self._control.seen_rest[k])

    def seen(self) -> list[Seen]:
        """The published processes (the daemon's own view; it is the only writer)."""
        control = self._control
        return [Seen(int(e.gpu), int(e.pidns), int(e.pid), int(e.start_time), int(e.bytes))
                for e in control.seen[:min(int(control.nseen), MAX_SEEN)]]

    # -- processes --

    def _slots_used(self) -> int:
        return min(int(self._account.slots_used), MAX_PROCS)

    def processes(self) -> list[ProcView]:
        """Every slot in state LIVE, as the processes wrote them (see `reclaim`)."""
        views = []
        n = self.ngpus
        for i in range(self._slots_used()):
            slot = self._account.proc[i]
            if slot.state != SLOT_LIVE:
                continue
            per = [slot.gpu[k] for k in range(n)]
            views.append(ProcView(
                slot=i, pid=int(slot.pid), start_time=int(slot.start_time),
                pidns=int(slot.pidns), comm=bytes(slot.comm).decode(errors="replace"),
                attach_ns=int(slot.attach_ns),
                mem=tuple(int(p.mem) for p in per),
                launches=tuple(int(p.launches) for p in per),
                pending=tuple(int(p.pending) for p in per),
                gate_wait_ns=tuple(int(p.gate_wait_ns) for p in per),
                contexts=tuple(int(p.contexts) for p in per),
                oom_refusals=tuple(int(p.oom_refusals) for p in per),
                ctx_bytes=tuple(int(p.ctx_bytes) for p in per),
                hijacked=max((int(p.hijacked) for p in per), default=0),
            ))
        return views

    def slot_gpu(self, slot: int, k: int) -> ProcGpu:
        """The live line of one slot on GPU k (for the dispatcher's fast reads)."""
        return self._account.proc[slot].gpu[k]  # type: ignore[no-any-return]

    def slot_pid(self, slot: int) -> int:
        """The pid (in the container's namespace) a slot was claimed by."""
        return int(self._account.proc[slot].pid)

    def live_slots(self) -> list[int]:
        used = self._slots_used()
        if not used:  # most containers, most of the time: looked at every round
            return []
        proc = self._account.proc
        return [i for i in range(used) if proc[i].state == SLOT_LIVE]

    def usage(self, k: int) -> int:
        """Bytes the container holds on GPU k: the sum of all slots (as reported)."""
        self._gpu(k)
        return sum(int(self._account.proc[i].gpu[k].mem) for i in range(self._slots_used()))

    def slot_figures(self, k: int) -> SlotFigures:
        """What a memory round reads of the live slots, in one pass (most regions,
        most of the time, have none: then at once)."""
        self._gpu(k)
        live = self.live_slots()
        if not live:
            return NO_SLOTS
        slots = [self._account.proc[i] for i in live]
        lines = [slot.gpu[k] for slot in slots]
        return SlotFigures(
            gate_wait_ns=sum(int(line.gate_wait_ns) for line in lines),
            oom_refusals=sum(int(line.oom_refusals) for line in lines),
            identities=frozenset((int(slot.pidns), int(slot.pid), int(slot.start_time))
                                 for slot in slots))

    def activity(self, k: int) -> Activity:
        """Launch counters of GPU k summed over live slots (compare between ticks)."""
        self._gpu(k)
        procs = self.processes()
        return Activity(
            launches=sum(p.launches[k] for p in procs),
            pending=sum(p.pending[k] for p in procs),
            gate_wait_ns=sum(p.gate_wait_ns[k] for p in procs),
        )

    def failed_open(self, k: int) -> FailedOpen | None:
        """The latest launch on GPU k that failed open after waiting, over the
        live slots (untrusted, like all they say), or None."""
        self._gpu(k)
        lines = [self._account.proc[i].gpu[k] for i in self.live_slots()]
        found = [FailedOpen(int(line.stale_heartbeat_ns), int(line.gate_wake_ns), at)
                 for line in lines if (at := int(line.failed_open_ns))]
        return max(found, key=lambda record: record.at_ns, default=None)

    def reclaim(self, is_alive: Callable[[ProcView], bool]) -> list[int]:
        """Zero the slots whose process `is_alive` says is gone; returns their pids.

        Safe against libcgpu doing the same at the same time (compare-and-swap
        on the slot state, then zeroing, which is idempotent)."""
        reclaimed = []
        for view in self.processes():
            if is_alive(view):
                continue
            slot = self._account.proc[view.slot]
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
