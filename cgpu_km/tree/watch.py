"""inotify on the control tree's writable nodes: which container or GPU was written."""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Mapping
from pathlib import Path

from cgpu_km.tree.nodes import NODES_BY_LEVEL, Level
from cgpu_km.tree.views import LOST, Change, GpuNodes

_WRITABLE = {level: tuple(n.name for n in NODES_BY_LEVEL[level].values() if n.writable)
             for level in (Level.GPU, Level.CONTAINER)}  # what the watcher watches

IN_MODIFY = 0x002
IN_CLOSE_WRITE = 0x008
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
FILE_WRITES = IN_MODIFY | IN_CLOSE_WRITE
DIR_CHANGES = IN_MOVED_TO | IN_CREATE | IN_DELETE
_EVENT = struct.Struct("iIII")


class Inotify:
    """A non-blocking inotify descriptor: add and remove watches, read events."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        self._fd = int(fd)

    def fileno(self) -> int:
        return self._fd

    def add(self, path: str, mask: int) -> int | None:
        """The watch descriptor, or None when `path` is gone (a caller catches up later)."""
        wd = int(self._libc.inotify_add_watch(self._fd, os.fsencode(path), mask))
        return wd if wd >= 0 else None

    def remove(self, wd: int) -> None:
        self._libc.inotify_rm_watch(self._fd, wd)  # fails harmlessly if already gone

    def events(self) -> list[tuple[int, int, str]]:
        """Every event queued now, as (watch descriptor, mask, name within a directory)."""
        found: list[tuple[int, int, str]] = []
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return found
            offset = 0
            while offset < len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                start = offset + _EVENT.size
                name = data[start:start + length].rstrip(b"\0")
                found.append((wd, mask, os.fsdecode(name)))
                offset = start + length

    def close(self) -> None:
        os.close(self._fd)


class InotifyWatcher:
    """inotify on the tree's writable nodes and `inst_ctl` (writes through the VFS
    raise events on FUSE and procfs alike; what the module changes by itself,
    the daemon's periodic poll still sees). The directories are watched too,
    for trees whose server replaces node files by a rename (the mount-free
    tree): a watch on a replaced file dies, the next `sync` sets a new one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._inotify = Inotify()
        self._by_wd: dict[int, Change] = {}
        self._by_path: dict[str, int] = {}
        self._watch_root()

    def _watch_root(self) -> None:
        """`upgrade`, `inst_ctl` and the root: at the start and at every sync (a
        remounted tree's watches went with the old mount)."""
        for node in ("upgrade", "inst_ctl"):
            self._add(f"{self.root}/{node}", Change(node=node))
        self._add(str(self.root), Change(node="upgrade"), DIR_CHANGES)

    def fileno(self) -> int:
        return self._inotify.fileno()

    def _add(self, path: str, change: Change, mask: int = FILE_WRITES) -> None:
        if path in self._by_path:
            return
        wd = self._inotify.add(path, mask)
        if wd is None:
            return  # gone meanwhile: the next sync or poll catches up
        self._by_path[path] = wd
        self._by_wd[wd] = change

    def sync(self, gpus: Mapping[int, GpuNodes]) -> None:
        # A directory's watch also takes its files' writes: a write that lands
        # between a file's replacement and its new watch is not missed.
        directory = DIR_CHANGES | FILE_WRITES
        wanted: dict[str, tuple[Change, int]] = {}
        for index, nodes in gpus.items():
            wanted[f"{self.root}/{index}"] = (Change(index), directory)
            for node in _WRITABLE[Level.GPU]:
                wanted[f"{self.root}/{index}/{node}"] = (Change(index), FILE_WRITES)
            for name in nodes.containers:
                wanted[f"{self.root}/{index}/{name}"] = (Change(index, name), directory)
                for node in _WRITABLE[Level.CONTAINER]:
                    wanted[f"{self.root}/{index}/{name}/{node}"] = (
                        Change(index, name), FILE_WRITES)
        for path in [p for p in self._by_path
                     if p not in wanted and self._by_wd[self._by_path[p]].gpu is not None]:
            wd = self._by_path.pop(path)
            self._by_wd.pop(wd, None)
            self._inotify.remove(wd)
        for path, (change, mask) in wanted.items():
            self._add(path, change, mask)
        self._watch_root()

    def changes(self) -> list[Change]:
        found: list[Change] = []
        for wd, mask, _name in self._inotify.events():
            if mask & IN_Q_OVERFLOW:  # the kernel dropped events: say so, read it all
                change: Change | None = LOST
            elif mask & IN_IGNORED:  # the file went (replaced): forget, sync re-adds
                change = self._by_wd.pop(wd, None)
                self._by_path = {p: w for p, w in self._by_path.items() if w != wd}
            else:
                change = self._by_wd.get(wd)
            if change is not None and change not in found:
                found.append(change)
        return found

    def close(self) -> None:
        self._inotify.close()
