"""The OCI hook's data-plane steps: a region for the container and libcgpu inside it.

prestart, for an enabled container:
  1. `create_region`: its region on the host (`region_path(id12)`, a folder
     only root can enter), limits from the plan, gates closed until the
     daemon grants the first slice, and the container's identity (its init's
     pid namespace and cgroups, `kernelview.Owner`) recorded beside it;
  2. (the hook registers the container in the control tree)
  3. `inject_data_plane`: bind-mount libcgpu.so at CONTAINER_LIBRARY_PATH,
     the region's control part at /run/cgpu/control and its account part at
     /run/cgpu/account (where libcgpu looks, whatever the environment says),
     and an /etc/ld.so.preload that adds the library to the image's own, so
     every dynamically linked process of the container loads it. A forked
     child enters the container's mount namespace (its init is still before
     pivot_root) and resolves each destination inside the rootfs as the
     container will (cgpu_km.container.inroot): the image's links never lead
     to the host, nor off the image's own filesystem. The image's own
     ld.so.preload is read the same way, only as a regular file of at most
     64 KiB. Then it checks from the container's side that each path names
     the mounted file; an image that makes any of this impossible keeps the
     container from starting, with one line naming the path and why.
poststop (`remove_data_plane`): delete the region (the mounts go away with
the container's mount namespace).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
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


def preload_text(own: bytes | None) -> bytes:
    """The image's own ld.so.preload (`own`, None when it has none) with libcgpu
    added once, as the last line."""
    library = region_mod.CONTAINER_LIBRARY_PATH.encode()
    lines = [line for line in (own or b"").splitlines() if line.strip() != library]
    return b"\n".join([*lines, library]) + b"\n"


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


def place_in_namespace(ns_fd: int, rootfs: Path, preload_fd: int,
                       prepared: list[tuple[Placement, int, tuple[int, int]]]) -> None:
    """In the container's mount namespace (this process enters it): write the
    preload file, mount every file where the container will find it, check."""
    inroot.enter_mount_namespace(ns_fd)
    root = inroot.Root(os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
    os.ftruncate(preload_fd, 0)
    os.pwrite(preload_fd, preload_text(root.read_small_file(PRELOAD_AT)), 0)
    for placement, tree, _ in prepared:
        _place(root, placement, tree)
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
                                              prepared))
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
    """prestart step: the region and the container's identity, on the host."""
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
    """prestart step: library, region and preload file inside the container."""
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
