"""The daemon's view of the containers' regions: attached as the tree lists them.

`Registry.attach` opens the region of every container the tree lists
(`<region dir>/<name>/`), reopens one that was replaced, forgets those that
went, and reads each one's recorded identity (`kernelview.Owner`). Regions
are never closed explicitly: a dispatcher thread may still read one, and
the mapping goes when the last reference does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Set
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from cgpu_km.dataplane import kernelview
from cgpu_km.dataplane import region as region_mod
from cgpu_km.tree.views import Key

log = logging.getLogger("cgpu-daemon")


@dataclass(frozen=True)
class Attached:
    """An open region, what identifies its file, and its container's identity."""

    name: str
    region: region_mod.Region
    identity: tuple[int, int]
    owner: kernelview.Owner | None


class Registry:
    """Regions by container name; safe to use from several threads."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._attached: dict[str, Attached] = {}
        self._containers: dict[int, frozenset[str]] = {}
        self._keys: Mapping[Key, tuple[Attached, int]] = {}
        self._warned: set[str] = set()
        # The last `owner_index`: of which `keys()`, for which host and /proc.
        self._owners: tuple[Mapping[Key, tuple[Attached, int]], kernelview.Host, str,
                            kernelview.OwnerIndex] | None = None

    def attach(self, containers: Mapping[int, Set[str]]) -> bool:
        """Follow the tree's containers; True when a region came, went or was replaced."""
        wanted = {gpu: frozenset(names) for gpu, names in containers.items()}
        names = {name for gpu_names in wanted.values() for name in gpu_names}
        with self._lock:
            before = dict(self._attached)
        after: dict[str, Attached] = {}
        for name in names:
            path = region_mod.region_path(name, self.directory)
            try:
                info = (path / region_mod.CONTROL_NAME).stat()
            except OSError:
                continue
            identity = (info.st_dev, info.st_ino)
            known = before.get(name)
            if known is not None and known.identity == identity:
                if known.owner is None:  # recorded after the region was made (cgpu-run)
                    known = Attached(name, known.region, identity, kernelview.read_owner(path))
                after[name] = known
                continue
            try:
                opened = region_mod.Region.open(path)
            except region_mod.RegionError as error:
                if name not in self._warned:
                    log.warning("container %s: %s", name, error)
                    self._warned.add(name)
                continue
            self._warned.discard(name)
            after[name] = Attached(name, opened, identity, kernelview.read_owner(path))
        keys = _keys(after, wanted)
        with self._lock:
            changed = after.keys() != before.keys() or any(
                after[n].region is not before[n].region for n in after)
            self._attached = after
            self._containers = wanted
            self._keys = keys
        return changed

    def missing(self) -> set[str]:
        """Containers the tree lists whose region, or its identity, is not (yet) there."""
        with self._lock:
            names = {n for gpu_names in self._containers.values() for n in gpu_names}
            return {n for n in names if n not in self._attached or self._attached[n].owner is None}

    def containers(self) -> dict[int, frozenset[str]]:
        with self._lock:
            return dict(self._containers)

    def get(self, name: str) -> Attached | None:
        with self._lock:
            return self._attached.get(name)

    def all(self) -> list[Attached]:
        with self._lock:
            return list(self._attached.values())

    def keys(self) -> Mapping[Key, tuple[Attached, int]]:
        """(gpu, name) -> (its region, the container GPU that host GPU is)."""
        with self._lock:
            return self._keys

    def owner_index(self, keys: Mapping[Key, tuple[Attached, int]], host: kernelview.Host,
                    proc: str) -> kernelview.OwnerIndex:
        """The owners of the containers in `keys` (what `keys()` returned), indexed
        to find a process's container (`kernelview.OwnerIndex`): built once for
        each attachment, not in every memory and compute round (200 containers'
        cgroups each time). Any thread may ask; two that build it at once build
        the same index."""
        cached = self._owners
        if cached is not None and cached[0] is keys and cached[1:3] == (host, proc):
            return cached[3]
        index = kernelview.OwnerIndex(
            {entry.name: entry.owner for entry, _k in keys.values() if entry.owner is not None},
            host, proc)
        self._owners = (keys, host, proc, index)
        return index

    def entries_for(self, gpu: int) -> dict[str, tuple[region_mod.Region, int]]:
        """What GPU `gpu`'s dispatcher drives: name -> (region, container GPU)."""
        return {name: (entry.region, k) for (g, name), (entry, k) in self.keys().items()
                if g == gpu}


def _keys(attached: Mapping[str, Attached], containers: Mapping[int, frozenset[str]]
          ) -> Mapping[Key, tuple[Attached, int]]:
    found: dict[Key, tuple[Attached, int]] = {}
    for gpu, names in containers.items():
        for name in names:
            entry = attached.get(name)
            if entry is None:
                continue
            k = entry.region.gpu_for_host(gpu)
            if k is not None:
                found[gpu, name] = (entry, k)
    return MappingProxyType(found)
