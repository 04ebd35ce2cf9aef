"""The OCI hook's data-plane steps: a region for the container and libcgpu inside it.

prestart, for an enabled container:
  1. `create_region`: its region on the host (`region_path(id12)`, a folder
     only root can enter), limits from the plan, gates closed until the
     daemon grants the first slice, and the container's identity (its init's
     pid namespace and cgroups, `kernelview.Owner`) recorded beside it;
  2. (the hook registers the container in the control tree)
  3. `inject_data_plane`: in the container's mount namespace (its init
     process is still before pivot_root, so host paths are visible),
     bind-mount libcgpu.so at CONTAINER_LIBRARY_PATH, the region's control
     part at /run/cgpu/control and its account part at /run/cgpu/account
     (where libcgpu looks, whatever the environment says), and an
     /etc/ld.so.preload that adds the library to the rootfs's own, so every
     dynamically linked process of the container loads it. Everything is
     remounted read-only except the account part: root in the container has
     no CAP_SYS_ADMIN (runc's default) and cannot remount it.
poststop (`remove_data_plane`): delete the region (the mounts go away with
the container's mount namespace).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cgpu_km import paths
from cgpu_km.container.steps import HookContext, HookError, Undo
from cgpu_km.dataplane import kernelview
from cgpu_km.dataplane import region as region_mod

PRELOAD_NAME = "ld.so.preload"


class InjectError(Exception):
    """A data-plane step failed; `str(error)` is the one-line message."""


def rootfs_of(bundle: Path) -> Path:
    """The container's root filesystem on the host, from config.json."""
    config = json.loads((bundle / "config.json").read_text())
    root = Path(config.get("root", {}).get("path", "rootfs"))
    return root if root.is_absolute() else bundle / root


def preload_text(rootfs: Path) -> str:
    """The rootfs's own ld.so.preload with libcgpu added (once)."""
    try:
        lines = (rootfs / "etc" / "ld.so.preload").read_text().splitlines()
    except OSError:
        lines = []
    lines = [line for line in lines if line.strip() != region_mod.CONTAINER_LIBRARY_PATH]
    return "\n".join([*lines, region_mod.CONTAINER_LIBRARY_PATH]) + "\n"


MOUNT_SCRIPT = r"""
set -e
bind() {  # bind SOURCE TARGET MODE: make TARGET (a file) exist, mount SOURCE on it
    mkdir -p "$(dirname "$2")"
    [ -e "$2" ] || : > "$2"
    mount --bind "$1" "$2"
    [ "$3" = rw ] || mount -o remount,bind,ro "$2"
}
bind "$LIB" "$ROOTFS$LIB_AT" ro
bind "$CONTROL" "$ROOTFS$REGION_AT/control" ro
bind "$ACCOUNT" "$ROOTFS$REGION_AT/account" rw
bind "$PRELOAD" "$ROOTFS/etc/ld.so.preload" ro
"""


def mount_into(pid: int, rootfs: Path, library: Path, region: Path) -> None:
    """Bind-mount the library, the region's two parts and the preload file into
    the mount namespace of `pid`; read-only but for the account part."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "ROOTFS": str(rootfs), "LIB": str(library),
        "CONTROL": str(region / region_mod.CONTROL_NAME),
        "ACCOUNT": str(region / region_mod.ACCOUNT_NAME),
        "PRELOAD": str(region / PRELOAD_NAME),
        "LIB_AT": region_mod.CONTAINER_LIBRARY_PATH,
        "REGION_AT": region_mod.CONTAINER_REGION_DIR,
    }
    result = subprocess.run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", "--", "sh", "-c",
                             MOUNT_SCRIPT], env=env, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or ["failed"])[-1]
        raise InjectError(f"mounting libcgpu into the container failed: {detail}")


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
        preload = path / PRELOAD_NAME
        preload.write_text(preload_text(rootfs))
        os.chmod(preload, 0o644)
        assert ctx.pid is not None
        mount_into(ctx.pid, rootfs, library, path)
    except (InjectError, OSError, ValueError) as error:
        raise HookError(str(error)) from None


def remove_data_plane(ctx: HookContext) -> None:
    """poststop step: idempotent."""
    region_mod.Region.remove(region_mod.region_path(ctx.id12))
