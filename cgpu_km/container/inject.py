"""The OCI hook's data-plane steps: a region for the container and libcgpu inside it.

At the start hook (createRuntime, or prestart), for an enabled container:
  1. `create_region`: its region on the host (`region_path(id12)`, a folder
     only root can enter), limits from the plan, gates closed until the
     daemon grants the first slice, and the container's identity (its init's
     pid namespace and cgroups, `kernelview.Owner`) recorded beside it;
  2. (the hook registers the container in the control tree)
  3. `inject_data_plane`: bind-mount libcgpu.so at CONTAINER_LIBRARY_PATH,
     the region's control part at /run/cgpu/control and its account part at
     /run/cgpu/account (a mount point there is where libcgpu looks, whatever
     the environment says), and an /etc/ld.so.preload whose first line is
     the library, so every dynamically linked process of the container loads
     it before anything else. A forked child enters the container's mount
     namespace (its init is still before pivot_root) and resolves each
     destination inside the rootfs as the container will
     (cgpu_km.container.inroot): the image's links never lead to the host,
     nor off the image's own filesystem (a volume, or a tmpfs the host also
     has mounted, is not the image's). The image's own ld.so.preload is read
     the same way, only as a regular file of at most 64 KiB, and kept after
     libcgpu only when it is clean text naming regular files of the image
     (`parse_preload`). Then it checks from the container's side that each
     path names the mounted file; an image that makes any of this impossible
     keeps the container from starting, with one line naming the path (and
     for its ld.so.preload the byte offset) and why.
poststop (`remove_data_plane`): delete the region (the mounts go away with
the container's mount namespace).
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cgpu_km import paths
from cgpu_km.container import inroot
from cgpu_km.container.steps import HookContext, HookError, Undo
from cgpu_km.dataplane import kernelview
from cgpu_km.dataplane import region as region_mod

PRELOAD_NAME = "ld.so.preload"
PRELOAD_AT = "/etc/ld.so.preload"


class InjectError(Exception):
    """A data-plane step failed; `str(error)` is the one-line message."""


def rootfs_of(bundle: Path) -> Path:
    """The container's root filesystem on the host, from config.json."""
    config = json.loads((bundle / "config.json").read_text())
    root = Path(config.get("root", {}).get("path", "rootfs"))
    return root if root.is_absolute() else bundle / root


PATH_MAX = 4096  # bytes of a path the loader opens, its NUL included
_WORD = re.compile(rb"#[^\n]*|[^ \t\n:#]+")  # a comment, or a name between separators


class PreloadError(inroot.InRootError):
    """The image's ld.so.preload is not clean; `offset` is the byte at fault."""

    def __init__(self, offset: int, message: str) -> None:
        super().__init__(message)
        self.offset = offset


@dataclass(frozen=True)
class PreloadEntry:
    """One library an image's ld.so.preload names, at byte `offset` of the file."""

    offset: int
    path: str

    def shown(self) -> str:
        """The name as an error line shows it (long ones cut)."""
        return self.path if len(self.path) <= 80 else self.path[:77] + "..."

    def where(self) -> str:
        return f"{PRELOAD_AT} in the image names {self.shown()} at offset {self.offset}"


def parse_preload(data: bytes) -> list[PreloadEntry]:
    """The libraries an image's ld.so.preload names, in its order, read as
    glibc's loader reads the file: names separated by spaces, tabs, newlines
    or ':', and a '#' starts a comment that ends with its line. The file must
    be clean, else PreloadError: every byte printable ASCII, a tab or a
    newline (the loader stops reading at a NUL, and binary bytes are no
    names), the first one that is not named by its offset; then every name
    an absolute path, without a '$' (which the loader would expand), shorter
    than PATH_MAX, the first one that is not named by its offset."""
    for offset, byte in enumerate(data):
        if byte == 0:
            raise PreloadError(offset, f"{PRELOAD_AT} in the image has a NUL byte at "
                                       f"offset {offset}")
        if not (0x20 <= byte < 0x7F or byte in b"\t\n"):
            raise PreloadError(offset, f"{PRELOAD_AT} in the image has the byte 0x{byte:02x} "
                                       f"at offset {offset}, which is not printable text")
    entries = []
    for match in _WORD.finditer(data):
        word = match.group()
        if word.startswith(b"#"):
            continue
        entry = PreloadEntry(match.start(), word.decode("ascii"))
        if not word.startswith(b"/"):
            raise PreloadError(entry.offset, f"{entry.where()}, which is not an absolute path")
        if b"$" in word:
            raise PreloadError(entry.offset, f"{entry.where()}, which has a $ that the loader "
                                             "would expand")
        if len(word) >= PATH_MAX:
            raise PreloadError(entry.offset, f"{entry.where()}, which is longer than "
                                             f"{PATH_MAX - 1} bytes")
        entries.append(entry)
    return entries


def preload_text(own: Sequence[str]) -> bytes:
    """The container's ld.so.preload: libcgpu first, then the image's own
    libraries `own` (checked, see `parse_preload`), each once, one a line."""
    library = region_mod.CONTAINER_LIBRARY_PATH
    lines = list(dict.fromkeys(path for path in own if path != library))
    return "\n".join([library, *lines]).encode() + b"\n"


_READ_ONLY = (inroot.MOUNT_ATTR_RDONLY | inroot.MOUNT_ATTR_NOSUID | inroot.MOUNT_ATTR_NODEV)
_DATA = inroot.MOUNT_ATTR_NOSUID | inroot.MOUNT_ATTR_NODEV | inroot.MOUNT_ATTR_NOEXEC


@dataclass(frozen=True)
class Placement:
    """One host file mounted at a path of the container, with these mount attributes."""

    source: Path
    at: str
    attributes: int


def placements(library: Path, region: Path) -> list[Placement]:
    """What goes into an enabled container; ld.so.preload last, so that no other
    file can be placed over it. Read-only but for the account part: root in
    the container has no CAP_SYS_ADMIN (runc's default) and cannot remount it."""
    at = region_mod.CONTAINER_REGION_DIR
    return [
        Placement(library, region_mod.CONTAINER_LIBRARY_PATH, _READ_ONLY),
        Placement(region / region_mod.CONTROL_NAME, f"{at}/control",
                  _READ_ONLY | inroot.MOUNT_ATTR_NOEXEC),
        Placement(region / region_mod.ACCOUNT_NAME, f"{at}/account", _DATA),
        Placement(region / PRELOAD_NAME, PRELOAD_AT, _READ_ONLY | inroot.MOUNT_ATTR_NOEXEC),
    ]


def _place(root: inroot.Root, placement: Placement, tree: int) -> None:
    entry = root.file_target(placement.at)
    try:
        assert entry.fd is not None
        inroot.attach(tree, entry.fd)
    finally:
        entry.close()


def _verify(root: inroot.Root, placement: Placement, identity: tuple[int, int]) -> None:
    """From the container's side: its path names the mounted file."""
    if root.identity(placement.at) != identity:
        raise inroot.InRootError(f"{placement.at} in the container is not the file the hook "
                                 f"mounted there")


def _kept(root: inroot.Root, entry: PreloadEntry, library: tuple[int, int]) -> bool:
    """Whether the image's own preload `entry` follows libcgpu (False: it is
    libcgpu). Looked up after the mounts, as the loader will find it: it must
    be a regular file of the image's own, else InRootError naming its offset."""
    if entry.path == region_mod.CONTAINER_LIBRARY_PATH:
        return False
    inside = f"{entry.path} in the image "
    try:
        if root.identity(entry.path) == library:
            return False
        found = root.image_file(entry.path)
    except inroot.InRootError as error:
        why = str(error)
        if not why.startswith(inside):
            raise
        raise inroot.InRootError(f"{entry.where()}, which {why.removeprefix(inside)}") from None
    except OSError as error:
        raise inroot.InRootError(f"{entry.where()}, which cannot be read: "
                                 f"{error.strerror}") from None
    if found is None:
        raise inroot.InRootError(f"{entry.where()}, which is not in the image")
    return True


def place_in_namespace(ns_fd: int, rootfs: Path, preload_fd: int,
                       prepared: list[tuple[Placement, int, tuple[int, int]]],
                       host: frozenset[str] = frozenset()) -> None:
    """In the container's mount namespace (this process enters it): read the
    image's own preload file, mount every file where the container will find
    it, write the preload file (libcgpu first, then the image's own libraries
    as the mounts left them), check. `host`: the filesystems the host's mount
    namespace has mounted (`inroot.host_devices`)."""
    inroot.enter_mount_namespace(ns_fd)
    root = inroot.Root(os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), host)
    own = parse_preload(root.read_small_file(PRELOAD_AT) or b"")
    for placement, tree, _ in prepared:
        _place(root, placement, tree)
    library = next(identity for placement, _, identity in prepared
                   if placement.at == region_mod.CONTAINER_LIBRARY_PATH)
    kept = [entry.path for entry in own if _kept(root, entry, library)]
    os.ftruncate(preload_fd, 0)
    os.pwrite(preload_fd, preload_text(kept), 0)
    for placement, _, identity in prepared:
        _verify(root, placement, identity)


def _in_child(work: Callable[[], None]) -> str | None:
    """Run `work` in a forked child (setns changes the whole process); its
    one-line failure, or None."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(reader)
        status = 0
        try:
            work()
        except inroot.InRootError as error:
            os.write(writer, f"{error}; libcgpu cannot be enforced".encode())
            status = 1
        except OSError as error:
            os.write(writer, f"placing libcgpu in the container failed: {error}".encode())
            status = 1
        except BaseException as error:
            os.write(writer, f"internal error: {type(error).__name__}: {error}".encode())
            status = 1
        finally:
            os._exit(status)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        message = pipe.read(4096).decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    return message or f"placing libcgpu in the container failed (status {status})"


def mount_into(pid: int, rootfs: Path, library: Path, region: Path) -> None:
    """Mount the library, the region's two parts and the preload file into the
    mount namespace of `pid`, each resolved inside `rootfs` as the container
    will resolve it (cgpu_km.container.inroot), and check them from its side."""
    fds: list[int] = []
    try:
        ns_fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        fds.append(ns_fd)
        preload_fd = os.open(region / PRELOAD_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644)
        fds.append(preload_fd)
        os.fchmod(preload_fd, 0o644)
        host = inroot.host_devices()  # read here, in the host's mount namespace
        prepared = []
        for placement in placements(library, region):
            source = os.open(placement.source, os.O_PATH | os.O_CLOEXEC)
            fds.append(source)
            found = os.fstat(source)
            tree = inroot.clone_tree(source, placement.attributes)
            fds.append(tree)
            prepared.append((placement, tree, (found.st_dev, found.st_ino)))
    except OSError as error:
        for fd in fds:
            os.close(fd)
        raise InjectError(f"preparing the mounts for the container failed: {error}") from None
    try:
        failure = _in_child(functools.partial(place_in_namespace, ns_fd, rootfs, preload_fd,
                                              prepared, host))
    finally:
        for fd in fds:
            os.close(fd)
    if failure is not None:
        raise InjectError(failure)


def injection_blocker(pid: int | None, rootfs: Path) -> str | None:
    """Why libcgpu cannot be mounted into this container, or None.

    Never mount into the hook's own mount namespace: that would change the
    host (a state with a wrong pid, or a runtime without mount namespaces)."""
    if pid is None:
        return "the OCI state has no pid"
    if not rootfs.is_dir():
        return f"its root filesystem {rootfs} is not a directory"
    try:
        theirs = os.readlink(f"/proc/{pid}/ns/mnt")
        ours = os.readlink("/proc/self/ns/mnt")
    except OSError as error:
        return f"cannot read the mount namespace of pid {pid}: {error.strerror}"
    if theirs == ours:
        return "it shares the hook's mount namespace"
    return None


def gpu_specs(ctx: HookContext) -> list[region_mod.GpuSpec]:
    ctx_bytes = region_mod.default_ctx_bytes()
    return [region_mod.GpuSpec(limit=gpu.memsize, uuid=gpu.uuid, host_index=gpu.index,
                               ctx_bytes=ctx_bytes) for gpu in ctx.plan.gpus]


def create_region(ctx: HookContext, undo: Undo) -> None:
    """Start step: the region and the container's identity, on the host."""
    path = region_mod.region_path(ctx.id12)
    try:
        region_mod.Region.create(path, ctx.id12, gpu_specs(ctx), mode=ctx.plan.mode or "cgpu",
                                 oom_script=ctx.plan.oom_script or "").close()
    except (region_mod.RegionError, OSError) as error:
        raise HookError(f"creating the region {path} failed: {error}") from None
    undo.push("region", lambda: region_mod.Region.remove(path))
    if ctx.pid is None:
        return  # nothing is injected either (see inject_data_plane)
    owner = kernelview.owner_of(ctx.pid)
    if owner is None:
        print(f"cgpu-hook: warning: no identity for {ctx.id12} (pid {ctx.pid} is gone): "
              f"its GPU processes cannot be told from the host's", file=sys.stderr)
        return
    try:
        kernelview.write_owner(path, owner)
    except OSError as error:
        raise HookError(f"recording the identity of {ctx.id12} failed: {error}") from None


def inject_data_plane(ctx: HookContext, undo: Undo) -> None:
    """Start step: library, region and preload file inside the container."""
    library = paths.libcgpu()
    if not library.is_file():
        raise HookError(f"{library} not found: build it with `make -C libcgpu` "
                        f"or set {paths.LIBCGPU_ENV}")
    path = region_mod.region_path(ctx.id12)
    try:
        rootfs = rootfs_of(ctx.bundle)
        blocker = injection_blocker(ctx.pid, rootfs)
        if blocker is not None:
            print(f"cgpu-hook: warning: libcgpu not injected into {ctx.id12}: {blocker}",
                  file=sys.stderr)
            return
        assert ctx.pid is not None
        mount_into(ctx.pid, rootfs, library, path)
    except (InjectError, OSError, ValueError) as error:
        raise HookError(str(error)) from None


def remove_data_plane(ctx: HookContext) -> None:
    """poststop step: idempotent."""
    region_mod.Region.remove(region_mod.region_path(ctx.id12))
