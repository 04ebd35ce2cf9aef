"""Paths of a container's root, resolved the way the container will resolve them.

A container's image is attacker input: any component of a path the hook
places a file at may be a link, absolute or relative, to anywhere. `Root`
walks such a path one component at a time from an open folder of the
container's root filesystem (`openat` with O_NOFOLLOW on held folder fds),
reads each link itself and goes on from the container's `/` for an absolute
target, and never climbs above that `/` on `..`: the walk the kernel does
with RESOLVE_IN_ROOT, done by hand so that the hook knows the path the
container will see (for its one-line errors) and where each folder is
mounted.

Every folder walked through must be on the root filesystem's own mount, or
on a tmpfs the runtime made for the container alone (ctr's /run, a
`--tmpfs`: mounted from its own root, not shared with any other mount, not
/dev, whose /dev/shm a runtime may share with the host, and a filesystem the
host's mount namespace does not have mounted anywhere: a bind of the host's
/run or /dev/shm, or a memory-backed emptyDir, is a tmpfs the host has too).
A link that leads onto /dev, /proc, /sys (which the runtime mounts, and
which differ between host and container) or onto a volume of the host is
refused, so nothing is ever created, truncated or mounted off the
container's own files.

The mounts themselves use the new mount API (Linux 5.12+), through ctypes:
`clone_tree` takes a detached copy of a host file's mount while the caller is
still in the host's mount namespace, `attach` puts it onto an fd of the
destination, so a mount lands on the very file the walk found.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import stat
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from cgpu_km.dataplane import kernelview

MAX_LINKS = 40  # as the kernel's path walk
PRELOAD_CAP = 64 << 10  # the largest ld.so.preload of an image that is read

_OPEN_TREE_CLONE = 1
_AT_EMPTY_PATH = 0x1000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOVE_MOUNT_T_EMPTY_PATH = 0x40
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
# The generic syscall numbers: the same on x86_64 and arm64 for these three.
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442
_CLONE_NEWNS = 0x00020000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class InRootError(Exception):
    """The image makes a path impossible to place safely; `str()` is the reason."""


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def enter_mount_namespace(ns_fd: int) -> None:
    """setns(2) into a mount namespace (the caller must be single-threaded)."""
    _check(_libc.setns(ns_fd, _CLONE_NEWNS), "setns")


def clone_tree(fd: int, attributes: int) -> int:
    """A detached bind mount of the file `fd` names, with mount `attributes` set."""
    tree = _check(_libc.syscall(_SYS_OPEN_TREE, fd, b"",
                                _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_EMPTY_PATH),
                  "open_tree")
    attr = _MountAttr(attr_set=attributes)
    _check(_libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH, ctypes.byref(attr),
                         ctypes.sizeof(attr)), "mount_setattr")
    return tree


def attach(tree: int, target: int) -> None:
    """Mount the detached `tree` onto the file or folder `target` (an fd)."""
    _check(_libc.syscall(_SYS_MOVE_MOUNT, tree, b"", target, b"",
                         _MOVE_MOUNT_F_EMPTY_PATH | _MOVE_MOUNT_T_EMPTY_PATH), "move_mount")


def mount_id(fd: int) -> int:
    """The id of the mount `fd` is on (any fd, O_PATH ones too)."""
    with open(f"/proc/self/fdinfo/{fd}") as info:
        for line in info:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(f"no mnt_id for fd {fd}")


@dataclass(frozen=True)
class MountInfo:
    """One line of /proc/self/mountinfo, the fields that matter here."""

    root: str  # the path inside its filesystem that is mounted
    fstype: str
    shared: bool  # it has a peer group: mounts on it propagate elsewhere
    device: str = ""  # its filesystem's st_dev as "major:minor"


def parse_mountinfo(text: str) -> dict[int, MountInfo]:
    """Mount id -> its information (proc(5)'s mountinfo; odd lines are skipped)."""
    mounts: dict[int, MountInfo] = {}
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields[6:] or not fields[0].isdigit():
            continue
        dash = fields.index("-", 6)
        if dash + 1 >= len(fields):
            continue
        shared = any(tag.startswith("shared:") for tag in fields[6:dash])
        mounts[int(fields[0])] = MountInfo(fields[3], fields[dash + 1], shared, fields[2])
    return mounts


def host_devices() -> frozenset[str]:
    """The filesystems ("major:minor") mounted anywhere in this process's mount
    namespace: called by the hook in the host's, before it enters a container's."""
    mounts = parse_mountinfo(kernelview.read_proc("/proc/self/mountinfo"))
    return frozenset(info.device for info in mounts.values())


def container_tmpfs(info: MountInfo | None, path: str,
                    host: frozenset[str] = frozenset()) -> bool:
    """Whether a mount at `path` (in the container) is a tmpfs of its own: not
    one whose filesystem the host (`host`, from `host_devices`) has mounted."""
    return (info is not None and info.fstype == "tmpfs" and info.root == "/"
            and not info.shared and path != "/dev" and not path.startswith("/dev/")
            and info.device not in host)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a pipe"
    return "a socket"


@dataclass
class Entry:
    """Where a path ends: the folder that holds it (an fd the caller closes),
    its name there, the path the container sees, and the entry's own fd
    (O_PATH, not followed) or None when nothing is there yet."""

    parent: int
    name: str
    path: str
    fd: int | None

    def close(self) -> None:
        for fd in (self.fd, self.parent):
            if fd is not None:
                os.close(fd)


class Root:
    """The container's root filesystem, open as `fd` (in its mount namespace);
    `host`: the filesystems mounted in the host's mount namespace
    (`host_devices`), which no folder walked through may be on, but the
    root filesystem's own mount."""

    def __init__(self, fd: int, host: frozenset[str] = frozenset()) -> None:
        self.fd = fd
        self.mount = mount_id(fd)
        self.host = host
        # Mount points are named by the image too (Docker mounts its VOLUMEs), in
        # any bytes: read_proc keeps those that are not UTF-8.
        self.mounts = parse_mountinfo(kernelview.read_proc("/proc/self/mountinfo"))

    def _on_image(self, fd: int, path: str, asked: str, link: str | None) -> None:
        mount = mount_id(fd)
        if mount != self.mount and not container_tmpfs(self.mounts.get(mount), path,
                                                       self.host):
            via = f"is a link to {link}, which leads to" if link else "is on"
            raise InRootError(f"{asked} in the image {via} {path or '/'}, a mount that is not "
                              "the image's own filesystem")

    def resolve(self, asked: str, *, make_folders: bool) -> Entry:
        """Walk `asked` (absolute, in the container) as the container will.

        The last component may be missing (its `fd` is None); missing folders
        before it are made when `make_folders`, else FileNotFoundError."""
        stack: list[tuple[int, str]] = [(os.dup(self.fd), "")]
        pending = deque(part for part in asked.split("/") if part)
        first_link: str | None = None
        links = changes = 0
        try:
            while pending:
                name = pending.popleft()
                if name == ".":
                    continue
                if name == "..":
                    if len(stack) > 1:
                        os.close(stack.pop()[0])
                    continue
                folder, folder_path = stack[-1]
                here = f"{folder_path}/{name}"
                try:
                    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
                except FileNotFoundError:
                    if not pending:
                        self._on_image(folder, folder_path, asked, first_link)
                        return Entry(stack.pop()[0], name, here, None)
                    if not make_folders:
                        raise
                    self._on_image(folder, folder_path, asked, first_link)
                    try:
                        os.mkdir(name, 0o755, dir_fd=folder)
                    except FileExistsError:  # made meanwhile: look again
                        changes += 1
                        if changes > MAX_LINKS:
                            raise InRootError(f"{asked} in the image keeps changing") from None
                        pending.appendleft(name)
                        continue
                    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
                mode = os.fstat(fd).st_mode
                if stat.S_ISLNK(mode):
                    target = os.readlink("", dir_fd=fd)
                    os.close(fd)
                    links += 1
                    if links > MAX_LINKS:
                        raise InRootError(f"{asked} in the image is a loop of links")
                    first_link = first_link or target
                    if target.startswith("/"):
                        while len(stack) > 1:
                            os.close(stack.pop()[0])
                    pending.extendleft(reversed([p for p in target.split("/") if p]))
                    continue
                if pending:
                    if not stat.S_ISDIR(mode):
                        os.close(fd)
                        raise InRootError(f"{asked} in the image passes through {here}, "
                                          f"which is {_kind(mode)}, not a folder")
                    stack.append((fd, here))
                    self._on_image(fd, here, asked, first_link)
                    continue
                self._on_image(folder, folder_path, asked, first_link)
                return Entry(stack.pop()[0], name, here, fd)
            raise InRootError(f"{asked} in the image is the root folder itself")
        finally:
            for fd, _ in stack:
                os.close(fd)

    def _image_file(self, asked: str, entry: Entry) -> None:
        """Refuse an entry that is not a plain file, or is a mount of its own."""
        assert entry.fd is not None
        mode = os.fstat(entry.fd).st_mode
        shown = "" if entry.path == asked else f" (at {entry.path})"
        if not stat.S_ISREG(mode):
            raise InRootError(f"{asked} in the image is {_kind(mode)}{shown}, not a file")
        if mount_id(entry.fd) != mount_id(entry.parent):
            raise InRootError(f"{asked} in the image is a mount{shown}, not a file of the "
                              "image's own filesystem")

    def file_target(self, asked: str) -> Entry:
        """An fd of the file at `asked` to mount onto: made (empty) if missing; a
        file of the image is used as it is (never truncated)."""
        for _ in range(MAX_LINKS):
            entry = self.resolve(asked, make_folders=True)
            try:
                if entry.fd is None:
                    entry.fd = os.open(entry.name, os.O_CREAT | os.O_EXCL | os.O_WRONLY
                                       | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                                       dir_fd=entry.parent)
                self._image_file(asked, entry)
            except (FileExistsError, FileNotFoundError):  # changed meanwhile: look again
                entry.close()
                continue
            except BaseException:
                entry.close()
                raise
            return entry
        raise InRootError(f"{asked} in the image keeps changing")

    @contextlib.contextmanager
    def _existing(self, asked: str) -> Iterator[Entry | None]:
        """The entry at `asked` when something is there, else None; closed after."""
        try:
            entry = self.resolve(asked, make_folders=False)
        except FileNotFoundError:
            yield None
            return
        try:
            yield entry if entry.fd is not None else None
        finally:
            entry.close()

    def read_small_file(self, asked: str, cap: int = PRELOAD_CAP) -> bytes | None:
        """The content of the regular file at `asked`, None when there is none.
        Anything but a regular file of at most `cap` bytes is InRootError."""
        with self._existing(asked) as entry:
            if entry is None:
                return None
            assert entry.fd is not None
            self._image_file(asked, entry)
            # Reopened through the fd itself (no name is looked up again): the
            # very file that was checked.
            fd = os.open(f"/proc/self/fd/{entry.fd}", os.O_RDONLY | os.O_NONBLOCK
                         | os.O_CLOEXEC)
            try:
                data = os.read(fd, cap + 1)
            finally:
                os.close(fd)
        if len(data) > cap:
            raise InRootError(f"{asked} in the image is larger than {cap >> 10} KiB")
        return data

    def image_file(self, asked: str) -> tuple[int, int] | None:
        """(st_dev, st_ino) of the regular file of the image's own at `asked`,
        None when nothing is there. Anything else (a folder, a device, a mount,
        a path off the image) is InRootError."""
        with self._existing(asked) as entry:
            if entry is None or entry.fd is None:
                return None
            self._image_file(asked, entry)
            found = os.fstat(entry.fd)
            return found.st_dev, found.st_ino

    def identity(self, asked: str) -> tuple[int, int] | None:
        """(st_dev, st_ino) of what `asked` names now, following mounts; None if absent."""
        with self._existing(asked) as entry:
            if entry is None or entry.fd is None:
                return None
            found = os.fstat(entry.fd)
            return found.st_dev, found.st_ino
