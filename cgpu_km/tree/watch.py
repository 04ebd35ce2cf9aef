"""inotify on the control tree's writable nodes: which container or GPU was written."""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Mapping
from pathlib import Path

from cgpu_km.tree.nodes import NODES_BY_LEVEL, Level
from cgpu_km.tree.views import Change, GpuNodes

_WRITABLE = {level: tuple(n.name for n in NODES_BY_LEVEL[level].values() if n.writable)
             for level in (Level.GPU, Level.CONTAINER)}  # what the watcher watches

_IN_MODIFY = 0x002
_IN_CLOSE_WRITE = 0x008
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_DELETE = 0x200
_IN_IGNORED = 0x8000
_DIR_EVENTS = _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
_EVENT = struct.Struct("iIII")


class InotifyWatcher:
    """inotify on the tree's writable nodes and `inst_ctl` (writes through the VFS
    raise events on FUSE and procfs alike; what the module changes by itself,
    the daemon's periodic poll still sees). The directories are watched too,
    for trees whose server replaces node files by a rename (the mount-free
    tree): a watch on a replaced file dies, the next `sync` sets a new one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._libc = ctypes.CDLL(None, use_errno=True)
        fd = self._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        self._fd = int(fd)
        self._by_wd: dict[int, Change] = {}
        self._by_path: dict[str, int] = {}
        for node in ("upgrade", "inst_ctl"):
            self._add(f"{root}/{node}", Change(node=node))
        self._add(str(root), Change(node="upgrade"), _DIR_EVENTS)

    def fileno(self) -> int:
        return self._fd

    def _add(self, path: str, change: Change, mask: int = _IN_MODIFY | _IN_CLOSE_WRITE) -> None:
        if path in self._by_path:
            return
        wd = self._libc.inotify_add_watch(self._fd, path.encode(), mask)
        if wd < 0:
            return  # gone meanwhile: the next sync or poll catches up
        self._by_path[path] = wd
        self._by_wd[wd] = change

    def sync(self, gpus: Mapping[int, GpuNodes]) -> None:
        wanted: dict[str, tuple[Change, int]] = {}
        files = _IN_MODIFY | _IN_CLOSE_WRITE
        for index, nodes in gpus.items():
            wanted[f"{self.root}/{index}"] = (Change(index), _DIR_EVENTS)
            for node in _WRITABLE[Level.GPU]:
                wanted[f"{self.root}/{index}/{node}"] = (Change(index), files)
            for name in nodes.containers:
                wanted[f"{self.root}/{index}/{name}"] = (Change(index, name), _DIR_EVENTS)
                for node in _WRITABLE[Level.CONTAINER]:
                    wanted[f"{self.root}/{index}/{name}/{node}"] = (Change(index, name), files)
        for path in [p for p in self._by_path
                     if p not in wanted and self._by_wd[self._by_path[p]].gpu is not None]:
            wd = self._by_path.pop(path)
            self._by_wd.pop(wd, None)
            self._libc.inotify_rm_watch(self._fd, wd)  # fails harmlessly if already gone
        for path, (change, mask) in wanted.items():
            self._add(path, change, mask)

    def changes(self) -> list[Change]:
        found: list[Change] = []
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return found
            offset = 0
            while offset < len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                if mask & _IN_IGNORED:  # the file went (replaced): forget, sync re-adds
                    gone = self._by_wd.pop(wd, None)
                    self._by_path = {p: w for p, w in self._by_path.items() if w != wd}
                    if gone is not None and gone not in found:
                        found.append(gone)
                    continue
                change = self._by_wd.get(wd)
                if change is not None and change not in found:
                    found.append(change)

    def close(self) -> None:
        os.close(self._fd)
