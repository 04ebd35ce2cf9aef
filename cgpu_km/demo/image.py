"""A small container image for the demo and the tests: busybox, simgpu's
`cuworkload` and the C libraries they and libcgpu link.

It has no GPU libraries, as an image for a GPU host has none: the runtime
mounts them (simgpu's on a host without a GPU, see cgpu_km.container.oci.spec), and
cgpu-hook mounts libcgpu. `build_rootfs` writes the folder (for runc, ctr
`--rootfs`), `rootfs_tar` the archive that `docker import` and
`podman import` take.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from collections.abc import Iterable
from pathlib import Path

from cgpu_km import paths

APPLETS = ("sh", "cat", "echo", "env", "grep", "ls", "sleep", "true", "false", "head",
           "tail", "wc", "test", "awk")
FOLDERS = ("bin", "proc", "dev", "sys", "tmp", "etc", "run", "usr/bin")


class ImageError(Exception):
    """Something the image needs is missing; `str(error)` is one line."""


def shared_libraries(binary: Path) -> set[Path]:
    """The libraries `binary` loads, as ldd resolves them here."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
    return {Path(word) for line in out.splitlines() for word in line.split()[:3]
            if word.startswith("/")}


def needed_libraries(binaries: Iterable[Path], skip: Path) -> set[Path]:
    return {lib for binary in binaries for lib in shared_libraries(binary)
            if skip not in lib.parents}


def build_rootfs(rootfs: Path) -> None:
    """Write the image's files into `rootfs`."""
    busybox = shutil.which("busybox")
    if busybox is None:
        raise ImageError("busybox is missing (apt-get install busybox-static)")
    simgpu = paths.simgpu_dir()
    workload = simgpu / "cuworkload"
    inputs = [workload, paths.libcgpu(), simgpu / "nvidia-smi", simgpu / "libcuda.so.1",
              simgpu / "libnvidia-ml.so.1"]
    missing = [str(p) for p in inputs if not p.is_file()]
    if missing:
        raise ImageError(f"not built: {', '.join(missing)} (run make build)")
    for folder in FOLDERS:
        (rootfs / folder).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, rootfs / "bin" / "busybox")
    for applet in APPLETS:
        (rootfs / "bin" / applet).symlink_to("busybox")
    shutil.copy2(workload, rootfs / "bin" / "cuworkload")
    for library in needed_libraries(inputs, simgpu):
        target = rootfs / str(library).lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(library.resolve(), target)


def rootfs_tar(rootfs: Path) -> bytes:
    """The rootfs as an uncompressed tar archive, owned by root."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path in sorted(rootfs.rglob("*")):
            info = archive.gettarinfo(str(path), arcname=str(path.relative_to(rootfs)))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if info.isfile():
                with path.open("rb") as handle:
                    archive.addfile(info, handle)
            else:
                archive.addfile(info)
    return buffer.getvalue()
