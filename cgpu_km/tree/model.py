"""The control tree's state model: every rule of the contract, no I/O.

`ControlTree` holds the root values, one `Gpu` per GPU directory and the
containers on each, and answers path-based `listdir`, `read` and `write`
calls exactly as `/proc/cgpu_km` does.  Every failure is a `TreeError`
carrying the contract's errno, raised before anything changes, so a failed
write leaves the tree as it was.  The FUSE tree serves this object; the
kernel module implements the same rules in C from the same node table.

Decisions of this model that the contract (docs/design.md) states as well (the
kernel module follows them too):
- Values are ASCII decimal digits with optional surrounding ASCII
  whitespace; a sign, `0x`, or more than `VALUE_WRITE_MAX` bytes is EINVAL.
- A container id may not be `.`, `..` or the name of a GPU-level node
  (it would shadow that file): EINVAL.
- `-<id>` accepts any valid id, not only 12-character ones; the legacy
  create form is exactly 13 bytes after the trailing newline is removed.
- `add` checks in this order: syntax and fixed ranges (EINVAL), the GPU
  (ENODEV), `weight` above the GPU's `max_inst` (EINVAL), an existing
  container (EEXIST), a full GPU (ENOSPC).  An explicit `weight=0` gives 0.
- The same container id on several GPUs shares one numeric instance id;
  ids are never reused while the tree lives.
- `meminfo`'s Free for a whole-device container (memsize 0) is computed
  from the GPU's total memory when the tree was told it, else it is 0.
"""

from __future__ import annotations

import argparse
import errno
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from cgpu_km import __version__
from cgpu_km.tree.nodes import (
    COMMAND_WRITE_MAX,
    ID_MAX_LEN,
    INST_CTL_USAGE,
    LEGACY_ID_LEN,
    MAX_GPUS,
    MAX_INST,
    NODES_BY_LEVEL,
    U64_MAX,
    VALUE_WRITE_MAX,
    Kind,
    Level,
    Node,
)

WHITESPACE = b" \t\n\v\f\r"  # the contract's whitespace, around values and between words
_ROOT = NODES_BY_LEVEL[Level.ROOT]
_GPU = NODES_BY_LEVEL[Level.GPU]
_CONTAINER = NODES_BY_LEVEL[Level.CONTAINER]
_ID_RE = re.compile(rf"[A-Za-z0-9_.-]{{1,{ID_MAX_LEN}}}")
_RESERVED_IDS = frozenset({".", ".."}) | frozenset(_GPU)


class TreeError(OSError):
    """A contract error: `errno` is what the file operation returns."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(code, reason)


def parse_value(data: bytes, limit: int = VALUE_WRITE_MAX) -> int:
    """Parse one decimal integer with optional surrounding whitespace."""
    if len(data) > limit:
        raise TreeError(errno.EINVAL, f"value longer than {limit} bytes")
    text = data.strip(WHITESPACE)
    if not text.isdigit():  # bytes.isdigit is ASCII-only; also rejects b""
        raise TreeError(errno.EINVAL, f"not a decimal integer: {data[:32]!r}")
    return int(text)


def check_id(name: str) -> str:
    """Return `name` if it is a valid container id, else raise EINVAL."""
    if not _ID_RE.fullmatch(name) or name in _RESERVED_IDS:
        raise TreeError(errno.EINVAL, f"invalid container id: {name[:80]!r}")
    return name


def free_weight(max_inst: int, weights: Iterable[int]) -> int:
    """The `free_weight` node: the weight of `max_inst` that no container holds
    (never below 0, so a view read across a change shows no debt)."""
    return max(0, max_inst - sum(weights))


@dataclass
class Container:
    """One container on one GPU."""

    name: str
    ident: int
    values: dict[str, int]
    procs: dict[int, int] = field(default_factory=dict)


@dataclass
class Gpu:
    """One GPU directory and its containers."""

    index: int
    values: dict[str, int]
    total_memory: int = 0
    containers: dict[str, Container] = field(default_factory=dict)

    def weight_sum(self, excluding: str | None = None) -> int:
        return sum(c.values["weight"] for n, c in self.containers.items() if n != excluding)

    def free_weight(self) -> int:
        return free_weight(self.values["max_inst"],
                           (c.values["weight"] for c in self.containers.values()))


# --- inst_ctl commands --------------------------------------------------------


@dataclass(frozen=True)
class Add:
    gpu: int
    name: str
    options: dict[str, int]


@dataclass(frozen=True)
class Delete:
    gpu: int | None  # None: every GPU
    name: str


@dataclass(frozen=True)
class Meminfo:
    gpu: int
    name: str
    procs: dict[int, int]


Command = Add | Delete | Meminfo

ADD_OPTIONS = tuple(node.name for node in _CONTAINER.values() if node.writable)


def _number(token: str, what: str) -> int:
    if not token.isascii() or not token.isdigit():
        raise TreeError(errno.EINVAL, f"{what} is not a decimal integer: {token[:32]!r}")
    return int(token)


def _key_values(tokens: list[str], what: str) -> list[tuple[str, str]]:
    pairs = []
    for token in tokens:
        key, sep, value = token.partition("=")
        if not sep:
            raise TreeError(errno.EINVAL, f"{what} must be key=value: {token[:32]!r}")
        pairs.append((key, value))
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise TreeError(errno.EINVAL, f"{what} repeats a key")
    return pairs


def parse_command(data: bytes) -> Command:
    """Parse one `inst_ctl` write into a command; syntax errors are EINVAL."""
    if len(data) > COMMAND_WRITE_MAX:
        raise TreeError(errno.EINVAL, f"command longer than {COMMAND_WRITE_MAX} bytes")
    try:
        text = data.strip(WHITESPACE).decode("ascii")
    except UnicodeDecodeError:
        raise TreeError(errno.EINVAL, "command is not ASCII") from None
    # bytes.split() splits on exactly the contract's whitespace (" \t\n\v\f\r");
    # str.split() would also split on 0x1c..0x1f.
    tokens = [word.decode("ascii") for word in data.split()]
    if not tokens:
        raise TreeError(errno.EINVAL, "empty command")
    verb, args = tokens[0], tokens[1:]
    if verb == "add" and len(args) >= 2:
        options = {}
        for key, value in _key_values(args[2:], "add option"):
            if key not in ADD_OPTIONS:
                raise TreeError(errno.EINVAL, f"unknown add option: {key[:32]!r}")
            options[key] = _number(value, key)
            _check_range(_CONTAINER[key], options[key], None)
        return Add(_number(args[0], "gpu"), check_id(args[1]), options)
    if verb == "del" and len(args) in (1, 2):
        gpu = _number(args[0], "gpu") if len(args) == 2 else None
        return Delete(gpu, check_id(args[-1]))
    if verb == "meminfo" and len(args) >= 2:
        procs = {}
        for pid, used in _key_values(args[2:], "meminfo entry"):
            procs[_number(pid, "pid")] = _number(used, "bytes")
            if not 0 < int(pid) <= 2**31 - 1 or procs[int(pid)] > U64_MAX:
                raise TreeError(errno.EINVAL, f"meminfo entry out of range: {pid}={used}")
        return Meminfo(_number(args[0], "gpu"), check_id(args[1]), procs)
    if len(tokens) == 1 and verb.startswith("-"):
        return Delete(None, check_id(verb[1:]))
    if len(tokens) == 1 and len(verb) == 1 + LEGACY_ID_LEN and verb[0].isdigit():
        return Add(int(verb[0]), check_id(verb[1:]), {})
    raise TreeError(errno.EINVAL, f"malformed command: {text[:64]!r}")


def _check_range(node: Node, value: int, gpu: Gpu | None) -> None:
    maximum = node.maximum
    if maximum == MAX_INST:
        # Without the GPU (parsing `add`), the bound is checked again once it is known.
        maximum = U64_MAX if gpu is None else gpu.values["max_inst"]
    if not node.minimum <= value <= maximum:
        raise TreeError(
            errno.EINVAL, f"{node.name}: {value} is outside {node.minimum}..{maximum}"
        )


# --- the tree -----------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """What a path names: a directory, or a node of some GPU or container."""

    node: Node | None  # None for a directory
    gpu: Gpu | None = None
    container: Container | None = None

    @property
    def is_dir(self) -> bool:
        return self.node is None


class ControlTree:
    """The whole control tree, with the contract's rules for every operation."""

    def __init__(
        self,
        gpus: int,
        *,
        policy: int = _GPU["policy"].initial,
        max_inst: int = _GPU["max_inst"].initial,
        prio_ratio: int = _GPU["prio_ratio"].initial,
        major: int = 0,
        gpu_memory: tuple[int, ...] = (),
        version: str = __version__,
    ) -> None:
        if not 1 <= gpus <= MAX_GPUS:
            raise ValueError(f"gpus must be 1..{MAX_GPUS}, not {gpus}")
        initial = {"policy": policy, "max_inst": max_inst, "prio_ratio": prio_ratio}
        for name, value in initial.items():
            node = _GPU[name]
            if not node.minimum <= value <= node.maximum:
                raise ValueError(f"{name} must be {node.minimum}..{node.maximum}, not {value}")
        self.version = version
        self.major = major
        self.values = {
            n.name: n.initial for n in _ROOT.values() if n.kind is Kind.VALUE
        }
        self.gpus = [
            Gpu(i, dict(initial), gpu_memory[i] if i < len(gpu_memory) else 0)
            for i in range(gpus)
        ]
        self._next_ident = 1

    # navigation

    def lookup(self, path: str) -> Entry:
        """Resolve a path relative to the root (`""`, `"0/policy"`, ...); ENOENT if absent."""
        parts = [p for p in path.split("/") if p]
        if not parts:
            return Entry(None)
        if len(parts) == 1 and parts[0] in _ROOT:
            return Entry(_ROOT[parts[0]])
        gpu = self._gpu_by_name(parts[0])
        if gpu is None or len(parts) > 3:
            raise TreeError(errno.ENOENT, f"no such node: {path}")
        if len(parts) == 1:
            return Entry(None, gpu)
        if len(parts) == 2 and parts[1] in _GPU:
            return Entry(_GPU[parts[1]], gpu)
        container = gpu.containers.get(parts[1])
        if container is None:
            raise TreeError(errno.ENOENT, f"no such node: {path}")
        if len(parts) == 2:
            return Entry(None, gpu, container)
        node = _CONTAINER.get(parts[2])
        if node is None:
            raise TreeError(errno.ENOENT, f"no such node: {path}")
        return Entry(node, gpu, container)

    def _gpu_by_name(self, name: str) -> Gpu | None:
        if name.isascii() and name.isdigit() and str(int(name)) == name:
            index = int(name)
            if index < len(self.gpus):
                return self.gpus[index]
        return None

    def listdir(self, path: str) -> list[str]:
        entry = self.lookup(path)
        if not entry.is_dir:
            raise TreeError(errno.ENOTDIR, f"not a directory: {path}")
        if entry.container is not None:
            return list(_CONTAINER)
        if entry.gpu is not None:
            return list(_GPU) + sorted(entry.gpu.containers)
        return list(_ROOT) + [str(g.index) for g in self.gpus]

    # reading

    def read(self, path: str) -> bytes:
        """The content of a node, as one consistent snapshot."""
        entry = self.lookup(path)
        if entry.node is None:
            raise TreeError(errno.EISDIR, f"is a directory: {path}")
        return self._render(entry, entry.node).encode()

    def _render(self, entry: Entry, node: Node) -> str:
        if node.kind is Kind.VERSION:
            return f"{self.version}\n"
        if node.kind is Kind.COMMAND:
            return INST_CTL_USAGE
        if node.kind is Kind.MEMINFO:
            assert entry.gpu is not None
            assert entry.container is not None
            return render_meminfo(entry.gpu, entry.container)
        return f"{self._value(entry, node)}\n"

    def _value(self, entry: Entry, node: Node) -> int:
        if node.name == "free_weight":
            assert entry.gpu is not None
            return entry.gpu.free_weight()
        if node.name == "major":
            return self.major
        if node.name == "id":
            assert entry.container is not None
            return entry.container.ident
        return self._values_of(entry)[node.name]

    def _values_of(self, entry: Entry) -> dict[str, int]:
        if entry.container is not None:
            return entry.container.values
        if entry.gpu is not None:
            return entry.gpu.values
        return self.values

    # writing

    def write(self, path: str, data: bytes) -> None:
        """Apply one write to a node, or raise with nothing changed."""
        entry = self.lookup(path)
        node = entry.node
        if node is None:
            raise TreeError(errno.EISDIR, f"is a directory: {path}")
        if node.kind is Kind.COMMAND:
            self.apply(parse_command(data))
            return
        if not node.writable:
            raise TreeError(errno.EPERM, f"read-only node: {path}")
        value = parse_value(data)
        _check_range(node, value, entry.gpu)
        check = _WRITE_CHECKS.get(node.name)
        if check is not None:
            check(entry, value)
        self._values_of(entry)[node.name] = value

    def apply(self, command: Command) -> None:
        """Carry out a parsed `inst_ctl` command, or raise with nothing changed."""
        if isinstance(command, Delete):
            gpus = self.gpus if command.gpu is None else [self._gpu(command.gpu)]
            holders = [g for g in gpus if command.name in g.containers]
            if not holders:
                raise TreeError(errno.ENOENT, f"no container {command.name}")
            for gpu in holders:
                del gpu.containers[command.name]
            return
        gpu = self._gpu(command.gpu)
        if isinstance(command, Meminfo):
            container = gpu.containers.get(command.name)
            if container is None:
                raise TreeError(errno.ENOENT, f"no container {command.name} on GPU {gpu.index}")
            container.procs = dict(sorted(command.procs.items()))
            return
        self._add(gpu, command)

    def _gpu(self, index: int) -> Gpu:
        if index >= len(self.gpus):
            raise TreeError(errno.ENODEV, f"no GPU {index}")
        return self.gpus[index]

    def _add(self, gpu: Gpu, command: Add) -> None:
        options = command.options
        if "weight" in options:
            _check_range(_CONTAINER["weight"], options["weight"], gpu)
        if command.name in gpu.containers:
            raise TreeError(errno.EEXIST, f"container {command.name} exists on GPU {gpu.index}")
        if len(gpu.containers) >= gpu.values["max_inst"]:
            raise TreeError(errno.ENOSPC, f"GPU {gpu.index} has max_inst containers")
        values = {name: options.get(name, _CONTAINER[name].initial) for name in ADD_OPTIONS}
        values["memsize"] = options.get("memsize", self.values["default_memsize"])
        values["weight"] = min(values["weight"], gpu.free_weight())
        gpu.containers[command.name] = Container(command.name, self._ident(command.name), values)

    def _ident(self, name: str) -> int:
        for gpu in self.gpus:
            if name in gpu.containers:
                return gpu.containers[name].ident
        ident = self._next_ident
        self._next_ident += 1
        return ident


def render_meminfo(gpu: Gpu, container: Container) -> str:
    """`Free: <bytes>` then one `PID: <pid> Mem: <bytes>` line per process."""
    limit = container.values["memsize"] or gpu.total_memory
    free = max(0, limit - sum(container.procs.values()))
    lines = [f"Free: {free}\n"]
    lines += [f"PID: {pid} Mem: {used}\n" for pid, used in container.procs.items()]
    return "".join(lines)


def _check_weight(entry: Entry, value: int) -> None:
    assert entry.gpu is not None
    assert entry.container is not None
    others = entry.gpu.weight_sum(excluding=entry.container.name)
    if others + value > entry.gpu.values["max_inst"]:
        raise TreeError(
            errno.ENOSPC,
            f"weight {value}: only {entry.gpu.values['max_inst'] - others} free on "
            f"GPU {entry.gpu.index}",
        )


def _check_max_inst(entry: Entry, value: int) -> None:
    assert entry.gpu is not None
    needed = max(len(entry.gpu.containers), entry.gpu.weight_sum())
    if value < needed:
        raise TreeError(errno.EBUSY, f"max_inst {value} is below the {needed} in use")


# The apply hooks of the generic write path, like null_blk's: a node with a
# rule beyond its range validates here, before the value is stored.
_WRITE_CHECKS = {"weight": _check_weight, "max_inst": _check_max_inst}


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every server of the tree takes: its GPUs and initial values."""
    parser.add_argument("--gpus", type=int, default=1, help=f"GPU directories, 1..{MAX_GPUS}")
    for node in _GPU.values():
        if node.kind is Kind.VALUE:
            parser.add_argument(
                f"--{node.name.replace('_', '-')}", type=int, default=node.initial,
                help=f"initial {node.name}, {node.minimum}..{node.maximum}",
            )
    parser.add_argument(
        "--gpu-memory", default="",
        help="comma list of each GPU's total bytes, for meminfo of whole-device containers",
    )


def tree_from_arguments(args: argparse.Namespace) -> ControlTree:
    """The tree that `add_tree_arguments`' options describe; ValueError names a bad one."""
    memory = tuple(int(x) for x in args.gpu_memory.split(",") if x)
    return ControlTree(args.gpus, policy=args.policy, max_inst=args.max_inst,
                       prio_ratio=args.prio_ratio, gpu_memory=memory)
