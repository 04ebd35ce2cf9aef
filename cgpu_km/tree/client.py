"""Client side of the control tree: find it, read it, write it.

Every tool reaches the tree through the filesystem, so the same code works
on `/proc/cgpu_km` (kernel module) and on the FUSE tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from cgpu_km.tree.nodes import NODES_BY_LEVEL, Level

PROC_ROOT = Path("/proc/cgpu_km")
FUSE_ROOT = Path("/run/cgpu_km")


def resolve_root(root: str | os.PathLike[str] | None = None) -> Path:
    """`--root`, then `$CGPU_KM_ROOT`, then /proc/cgpu_km if present, else /run/cgpu_km."""
    if root:
        return Path(root)
    if os.environ.get("CGPU_KM_ROOT"):
        return Path(os.environ["CGPU_KM_ROOT"])
    return PROC_ROOT if os.path.exists(PROC_ROOT) else FUSE_ROOT


def serves(root: Path) -> bool:
    """Whether a control tree answers at `root`. False for a missing path and for
    a dead FUSE mount alike: there `stat` fails with ENOTCONN, which
    `Path.exists` raises rather than answers."""
    return os.path.exists(root / "inst_ctl")


def _write(path: Path, data: str) -> None:
    # One write(2) per command: the tree takes each write as a whole.
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


def inst_ctl(root: str | os.PathLike[str], command: str) -> None:
    """Send one command to `inst_ctl`; raises OSError with the contract's errno."""
    _write(Path(root) / "inst_ctl", command + "\n")


def write_node(root: str | os.PathLike[str], relpath: str, value: int) -> None:
    """Write one integer to a node such as `0/policy` or `0/abc/weight`."""
    _write(Path(root) / relpath, f"{value}\n")


def read_int(path: Path) -> int:
    return int(path.read_text().strip())


def parse_meminfo(text: str) -> tuple[int, dict[int, int]]:
    """Parse `meminfo` content into (free bytes, {pid: bytes})."""
    free = 0
    procs: dict[int, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if fields[:1] == ["Free:"] and len(fields) == 2:
            free = int(fields[1])
        elif len(fields) == 4 and fields[0] == "PID:" and fields[2] == "Mem:":
            procs[int(fields[1])] = int(fields[3])
    return free, procs


@dataclass
class ContainerView:
    """All of one container's nodes, as `cgpu-smi` shows them."""

    name: str
    id: int
    memsize: int
    weight: int
    highprio: int
    util_limit: int
    free: int
    procs: dict[int, int] = field(default_factory=dict)


@dataclass
class GpuView:
    index: int
    policy: int
    max_inst: int
    prio_ratio: int
    free_weight: int
    major: int
    containers: dict[str, ContainerView] = field(default_factory=dict)


@dataclass
class TreeView:
    version: str
    default_memsize: int
    upgrade: int
    gpus: list[GpuView] = field(default_factory=list)


_GPU_NODES = set(NODES_BY_LEVEL[Level.GPU])


def read_container(directory: Path) -> ContainerView:
    free, procs = parse_meminfo((directory / "meminfo").read_text())
    return ContainerView(
        name=directory.name,
        id=read_int(directory / "id"),
        memsize=read_int(directory / "memsize"),
        weight=read_int(directory / "weight"),
        highprio=read_int(directory / "highprio"),
        util_limit=read_int(directory / "util_limit"),
        free=free,
        procs=procs,
    )


def read_gpu(directory: Path) -> GpuView:
    gpu = GpuView(
        index=int(directory.name),
        policy=read_int(directory / "policy"),
        max_inst=read_int(directory / "max_inst"),
        prio_ratio=read_int(directory / "prio_ratio"),
        free_weight=read_int(directory / "free_weight"),
        major=read_int(directory / "major"),
    )
    for name in sorted(os.listdir(directory)):
        if name in _GPU_NODES:
            continue
        try:
            gpu.containers[name] = read_container(directory / name)
        except FileNotFoundError:
            continue  # removed while we were reading
    return gpu


def read_tree(root: str | os.PathLike[str]) -> TreeView:
    """Read the whole tree; containers removed mid-read are skipped."""
    top = Path(root)
    view = TreeView(
        version=(top / "version").read_text().strip(),
        default_memsize=read_int(top / "default_memsize"),
        upgrade=read_int(top / "upgrade"),
    )
    gpu_dirs = sorted((p for p in top.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    view.gpus = [read_gpu(p) for p in gpu_dirs]
    return view
