"""The control tree as the daemon reads it: plain values, one per read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

Key = tuple[int, str]  # a container on a GPU: (host GPU index, container name)


@dataclass(frozen=True)
class GpuNodes:
    """The per-GPU nodes the daemon polls every period (cheap), and the container names."""

    policy: int
    max_inst: int
    prio_ratio: int
    containers: frozenset[str]


@dataclass(frozen=True)
class QuickView:
    upgrade: int
    gpus: Mapping[int, GpuNodes]
    version: str = ""  # only read on request (it never changes under a running tree)


@dataclass(frozen=True)
class ContainerNodes:
    """The container nodes the daemon uses."""

    id: int
    memsize: int
    weight: int
    highprio: int
    util_limit: int


CONTAINER_NODES = tuple(f.name for f in fields(ContainerNodes))  # checked against nodes.py
GPU_NODES = tuple(f.name for f in fields(GpuNodes) if f.name != "containers")


@dataclass(frozen=True)
class Change:
    """A node written: `gpu`/`name` say where (gpu None: the root's `node`;
    name None: a GPU node)."""

    gpu: int | None = None
    name: str | None = None
    node: str | None = None  # for the root: "inst_ctl" or "upgrade"


# Changes were lost (the watcher's queue overflowed): any node may have been written.
LOST = Change(node="lost")
