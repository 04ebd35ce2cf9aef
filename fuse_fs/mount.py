"""cgpu-fuse: serve the control tree with FUSE, for hosts without the module.

The tree's rules live in `cgpu_km.tree.model.ControlTree`; this file only maps
FUSE operations onto it.  Files are opened with `direct_io` and a snapshot
of the content taken at open, so `cat` sees one consistent value; sizes are
reported as 4096 (as sysfs does) so readers that trust `st_size` or use
`sendfile` read the whole value; entry caching is off so a removed container
is gone for the very next lookup. A node's attributes never change (its mode
and size are fixed, its times the mount's), so they are cached, and FLUSH is
refused once, so that a close is not a round trip of its own.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import os
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import fuse

from cgpu_km.tree.model import ControlTree, TreeError, add_tree_arguments, tree_from_arguments

FILE_SIZE = 4096
ATTR_TIMEOUT = 60.0  # seconds; attributes never change, and a lookup is never cached
DIR_MODE = 0o555


def _refuse(*_args: Any) -> NoReturn:
    raise fuse.FuseOSError(errno.EPERM)


class ControlTreeFS(fuse.Operations):  # type: ignore[misc]
    """fusepy operations over a `ControlTree`, serialized by one lock."""

    use_ns = True

    def __init__(self, tree: ControlTree) -> None:
        self._tree = tree
        self._mutex = threading.Lock()
        self._snapshots: dict[int, bytes] = {}
        self._handles = itertools.count(1)
        self._mounted_ns = time.time_ns()

    def _call(self, op: Callable[[], Any]) -> Any:
        """Run one tree operation; contract errors become their errno."""
        with self._mutex:
            try:
                return op()
            except TreeError as error:
                raise fuse.FuseOSError(error.errno) from None

    def getattr(self, path: str, fh: Any = None) -> dict[str, int]:
        entry = self._call(lambda: self._tree.lookup(path))
        if entry.node is None:
            mode, size, nlink = stat.S_IFDIR | DIR_MODE, 0, 2
        else:
            mode, size, nlink = stat.S_IFREG | entry.node.mode, FILE_SIZE, 1
        now = self._mounted_ns
        return {
            "st_mode": mode, "st_nlink": nlink, "st_size": size, "st_uid": 0, "st_gid": 0,
            "st_atime": now, "st_mtime": now, "st_ctime": now,
        }

    def readdir(self, path: str, fh: Any) -> list[str]:
        return [".", "..", *self._call(lambda: self._tree.listdir(path))]

    def open(self, path: str, fi: Any) -> int:
        fi.direct_io = 1
        fi.keep_cache = 0
        handle = next(self._handles)
        if (fi.flags & os.O_ACCMODE) != os.O_WRONLY:
            snapshot = self._call(lambda: self._tree.read(path))
            with self._mutex:
                self._snapshots[handle] = snapshot
        else:
            self._call(lambda: self._tree.lookup(path))
        fi.fh = handle
        return 0

    def read(self, path: str, size: int, offset: int, fi: Any) -> bytes:
        with self._mutex:
            data = self._snapshots.get(fi.fh, b"")
        return data[offset : offset + size]

    def write(self, path: str, data: bytes, offset: int, fi: Any) -> int:
        self._call(lambda: self._tree.write(path, data))
        return len(data)

    def flush(self, path: str, fi: Any) -> int:
        # ENOSYS tells the kernel not to send FLUSH again: a write's value is
        # applied, and its error returned, by the write itself.
        raise fuse.FuseOSError(errno.ENOSYS)

    def release(self, path: str, fi: Any) -> int:
        with self._mutex:
            self._snapshots.pop(fi.fh, None)
        return 0

    def truncate(self, path: str, length: int, fh: Any = None) -> int:
        self._call(lambda: self._tree.lookup(path))
        return 0  # `echo 3 > policy` opens with O_TRUNC; the write carries the value

    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": FILE_SIZE, "f_namemax": 255}

    # The tree's shape is changed only through inst_ctl.
    mkdir = rmdir = unlink = rename = create = mknod = symlink = link = _refuse
    chmod = chown = utimens = setxattr = removexattr = _refuse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cgpu-fuse", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="/run/cgpu_km", help="mount point (default %(default)s)")
    add_tree_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        tree = tree_from_arguments(args)
    except ValueError as error:
        print(f"cgpu-fuse: {error}", file=sys.stderr)
        return 2
    os.makedirs(args.root, exist_ok=True)
    fuse.FUSE(
        ControlTreeFS(tree), args.root, raw_fi=True, foreground=True, allow_other=True,
        default_permissions=True, attr_timeout=ATTR_TIMEOUT, entry_timeout=0,
        negative_timeout=0,
        fsname="cgpu_km", subtype="cgpu_km",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
