"""The node table: the single source of truth for the control tree.

Every file of `/proc/cgpu_km` (kernel module) and of the FUSE tree is
described by one `Node` here: its level in the tree, its mode, what kind of
content it holds, the range a write must fall in and its initial value.  The
FUSE tree is built from this table at run time; the kernel module's C table
is generated from it (`cgpu_km.tree.kmod_header`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

U64_MAX = 2**64 - 1


class Level(enum.Enum):
    """Where a node lives: the root, each GPU directory, each container directory."""

    ROOT = "root"
    GPU = "gpu"
    CONTAINER = "container"


class Kind(enum.Enum):
    """How a node's content is produced and written."""

    VALUE = "value"  # one integer, read and (if writable) written through the generic path
    DERIVED = "derived"  # one integer computed from other state, read-only
    VERSION = "version"  # the version string
    COMMAND = "command"  # inst_ctl: a command per write, a usage line on read
    MEMINFO = "meminfo"  # the per-process memory report


# Modes of the contract (docs/design.md): 0644 for rw, 0444 for r, 0600 for inst_ctl
# (root only, either way: a read is its usage line).
RW = 0o644
RO = 0o444
CTL = 0o600

# A maximum that is not a constant but the GPU's current `max_inst`.
MAX_INST = -1


@dataclass(frozen=True)
class Node:
    """One file of the control tree."""

    name: str
    level: Level
    mode: int
    kind: Kind
    minimum: int = 0
    maximum: int = 0  # an integer, or MAX_INST
    initial: int = 0
    doc: str = ""  # one line for the generated doc tables (cgpu_km.tree.doctable)

    @property
    def writable(self) -> bool:
        return bool(self.mode & 0o200)


NODES: tuple[Node, ...] = (
    Node("version", Level.ROOT, RO, Kind.VERSION, doc="the version of the server, `X.Y.Z`"),
    Node(
        "default_memsize", Level.ROOT, RW, Kind.VALUE, 0, U64_MAX, 0,
        "bytes given to a container added without `memsize=`; `0` means the whole device",
    ),
    Node(
        "inst_ctl", Level.ROOT, CTL, Kind.COMMAND,
        doc="the command channel (add, del, meminfo); a read prints one usage line",
    ),
    Node(
        "upgrade", Level.ROOT, RW, Kind.VALUE, 0, 1, 0,
        "`1` asks the daemon for a hot update; the daemon writes `0` back when it is done",
    ),
    Node("policy", Level.GPU, RW, Kind.VALUE, 0, 5, 1, "the scheduling policy of the GPU"),
    Node(
        "max_inst", Level.GPU, RW, Kind.VALUE, 1, 25, 16,
        "most containers on the GPU, and most total weight",
    ),
    Node(
        "prio_ratio", Level.GPU, RW, Kind.VALUE, 20, 99, 80,
        "percent of the GPU an active high-priority container may take",
    ),
    Node(
        "free_weight", Level.GPU, RO, Kind.DERIVED,
        doc="`max_inst` minus the sum of the weights of the GPU's containers",
    ),
    Node(
        "major", Level.GPU, RO, Kind.DERIVED,
        doc="major number of the module's character device; `0` on FUSE",
    ),
    Node(
        "id", Level.CONTAINER, RO, Kind.DERIVED,
        doc="numeric instance id, unique on the host, shared by one container's GPUs",
    ),
    Node(
        "memsize", Level.CONTAINER, RW, Kind.VALUE, 1, U64_MAX, 0,
        "memory limit in bytes; reads `0` when the container has the whole device",
    ),
    Node(
        "meminfo", Level.CONTAINER, RO, Kind.MEMINFO,
        doc="`Free: <bytes>`, then `PID: <pid> Mem: <bytes>` per process",
    ),
    Node(
        "weight", Level.CONTAINER, RW, Kind.VALUE, 0, MAX_INST, 1,
        "compute weight; the GPU's sum never exceeds `max_inst`",
    ),
    Node(
        "highprio", Level.CONTAINER, RW, Kind.VALUE, 0, 1, 0,
        "`1` makes the container high-priority",
    ),
    Node(
        "util_limit", Level.CONTAINER, RW, Kind.VALUE, 0, 95, 0,
        "most percent of GPU time the container may use; `0` for no cap",
    ),
)

NODES_BY_LEVEL: dict[Level, dict[str, Node]] = {
    level: {node.name: node for node in NODES if node.level is level} for level in Level
}

# Limits of the inst_ctl channel and of container ids.
ID_MAX_LEN = 64
LEGACY_ID_LEN = 12
VALUE_WRITE_MAX = 64  # longest write accepted by a value node
COMMAND_WRITE_MAX = 4096  # longest write accepted by inst_ctl
MAX_GPUS = 16

INST_CTL_USAGE = (
    "usage: <g><id12> | -<id> | add <gpu> <id> [memsize=B] [weight=W] [highprio=0|1]"
    " [util_limit=P] | del [<gpu>] <id> | meminfo <gpu> <id> [<pid>=<bytes> ...]\n"
)
