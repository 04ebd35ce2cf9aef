"""End to end: a workload inside a real runc container, configured only by its
environment, hits exactly its limit. The OCI hook registers the container,
creates its region and mounts libcgpu (ld.so.preload) and the region into it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cgpu_km.container.oci.spec import START_STAGES
from tests.libcgpu.sandbox import Built

RUNC = shutil.which("runc")
BUSYBOX = shutil.which("busybox")
HOOK = Path(sys.executable).parent / "cgpu-hook"
MiB = 1 << 20
GPU_UUID = "GPU-e2e00000-0000-4000-8000-000000000000"
DEVICES = f"Tesla T4:15109MiB:{GPU_UUID}"
LIMIT = 15109 * MiB * 6 // 15  # ALIYUN_COM_GPU_MEM_CONTAINER=6, ALIYUN_COM_GPU_MEM_DEV=15

pytestmark = [
    pytest.mark.skipif(RUNC is None, reason="runc not installed (apt-get install runc)"),
    pytest.mark.skipif(BUSYBOX is None, reason="busybox not installed (busybox-static)"),
    pytest.mark.skipif(shutil.which("nsenter") is None, reason="nsenter (util-linux) missing"),
]


def shared_libraries(binary: Path) -> list[Path]:
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        for part in parts:
            if part.startswith("/"):
                found.append(Path(part))
                break
    return found


def make_rootfs(root: Path, built: Built) -> None:
    """busybox for the shell, the workload with its libraries, simgpu's libraries."""
    for folder in ("bin", "proc", "dev", "sys", "tmp", "etc", "run"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    assert BUSYBOX is not None
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in ("sh", "cat"):
        (root / "bin" / applet).symlink_to("busybox")
    shutil.copy2(built.workload, root / "workload")
    libs = set(shared_libraries(built.workload))
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        libs.update(shared_libraries(built.simgpu_dir / name))
    libs.update(shared_libraries(built.libcgpu))
    for lib in libs:
        if "simgpu" in str(lib):
            continue
        target = root / str(lib).lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib.resolve(), target)
    gpu_libs = root / "usr" / "lib" / "x86_64-linux-gnu"
    gpu_libs.mkdir(parents=True, exist_ok=True)
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        shutil.copy2(built.simgpu_dir / name, gpu_libs / name)


def bundle_for(tmp: Path, tree: Path, rootfs: Path, state: Path, command: str,
               start: str) -> Path:
    bundle = tmp / "bundle"
    bundle.mkdir()
    assert RUNC is not None
    subprocess.run([RUNC, "spec", "--bundle", str(bundle)], check=True, timeout=30)
    config = json.loads((bundle / "config.json").read_text())
    config["root"] = {"path": str(rootfs), "readonly": False}
    config["process"]["terminal"] = False
    config["process"]["args"] = ["/bin/sh", "-c", command]
    config["process"]["env"] = [
        "PATH=/bin", "LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu",
        "ALIYUN_COM_GPU_MEM_CONTAINER=6", "ALIYUN_COM_GPU_MEM_DEV=15",
        "NVIDIA_VISIBLE_DEVICES=0", f"SIMGPU_DEVICES={DEVICES}", "SIMGPU_STATE=/simgpu-state",
        "SIMGPU_CONTEXT_MEM=0",
    ]
    config["mounts"].append({"destination": "/simgpu-state", "type": "bind",
                             "source": str(state), "options": ["bind", "rw"]})
    hook_env = [f"PATH={os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}",
                "CGPU_SIMULATE=1", f"SIMGPU_DEVICES={DEVICES}", f"SIMGPU_STATE={state}",
                f"CGPU_SIMGPU_DIR={Path(__file__).resolve().parents[2] / 'simgpu'}",
                f"CGPU_REGION_DIR={tmp / 'regions'}", "SIMGPU_CONTEXT_MEM=0"]
    config["hooks"] = {
        stage: [{"path": str(HOOK), "args": ["cgpu-hook", "--root", str(tree), stage],
                 "env": hook_env, "timeout": 60}]
        for stage in (*(START_STAGES if start == "both" else (start,)), "poststop")
    }
    (bundle / "config.json").write_text(json.dumps(config, indent=1))
    return bundle


@pytest.mark.parametrize("start", [*START_STAGES, "both"])  # both: one start calls it twice
@pytest.mark.parametrize("control_tree", [1], indirect=True)
def test_container_hits_exactly_its_limit(built: Built, control_tree: Path,
                                          tmp_path: Path, start: str) -> None:
    rootfs = tmp_path / "rootfs"
    make_rootfs(rootfs, built)
    state = tmp_path / "simgpu-state"
    env = {"PATH": os.environ.get("PATH", "/bin"), "SIMGPU_DEVICES": DEVICES,
           "SIMGPU_STATE": str(state), "LD_LIBRARY_PATH": str(built.simgpu_dir)}
    subprocess.run([str(built.workload), "ctx"], env=env, check=True, capture_output=True)
    command = f"/workload alloc {LIMIT} alloc 1 free alloc 1 info; cat /etc/ld.so.preload"
    bundle = bundle_for(tmp_path, control_tree, rootfs, state, command, start)
    container_id = "e2e" + uuid.uuid4().hex[:20]
    assert RUNC is not None
    try:
        result = subprocess.run([RUNC, "run", "--bundle", str(bundle), container_id],
                                stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=120)
    finally:
        subprocess.run([RUNC, "delete", "--force", container_id], capture_output=True,
                       timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        f"alloc {LIMIT} rc=0", "alloc 1 rc=2", "free rc=0", "alloc 1 rc=0",
        f"info free={LIMIT - 1} total={LIMIT} rc=0",
        "/usr/local/lib/cgpu/libcgpu.so",
    ]
    assert not (control_tree / "0" / container_id[:12]).exists()
    assert list((tmp_path / "regions").iterdir()) == []
