"""A host job's region is the one cgpu-run gave it (issue 36, item 5).

A host whose /run holds a /run/cgpu/control that is no mount point (the
empty files a hook once made on a host's /run through a volume, or another
job's region copied there) runs `cgpu-run --memsize 256MiB`: the job gets
its 256 MiB, never what lies at /run/cgpu. Only a mount point at
/run/cgpu/control (the hook's bind mount in a container) is used whatever
$CGPU_REGION says; a process with neither is not limited. Each case runs in a
mount namespace of its own with a tmpfs over /run, so the host's /run is
never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cgpu_km import paths
from cgpu_km.dataplane import region as region_mod

CGPU_RUN = Path(sys.executable).parent / "cgpu-run"
MIB = 1 << 20
OWN, OTHER = 256 * MIB, 512 * MIB
DEVICE = 15109 * MIB
CUWORKLOAD = paths.simgpu_dir() / "cuworkload"

pytestmark = [
    pytest.mark.skipif(not CUWORKLOAD.is_file() or not paths.libcgpu().is_file(),
                       reason="simgpu and libcgpu are not built (make build)"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare is not installed"),
]

# In a private mount namespace: a tmpfs over /run, then /run/cgpu as the case
# wants it ($1: the stray region's folder, $2: how), then the job ("$@").
SETUP = """
set -e
stray=$1 how=$2
shift 2
mount -t tmpfs none /run
mkdir /run/cgpu
case $how in
    copied) cp "$stray/control" "$stray/account" /run/cgpu/ ;;
    empty) : > /run/cgpu/control; : > /run/cgpu/account ;;
    mounted) for part in control account; do
                 : > /run/cgpu/$part; mount --bind "$stray/$part" /run/cgpu/$part
             done ;;
esac
exec "$@"
"""


def job_env(tmp_path: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "CGPU_SIMGPU_DIR", "CGPU_REGION")}
    env.update({"CGPU_SIMULATE": "1", "CGPU_REGION_DIR": str(tmp_path / "regions"),
                "SIMGPU_STATE": str(tmp_path / "state"), "SIMGPU_CONTEXT_MEM": "0"})
    return env


def total_seen(tmp_path: Path, how: str, job: list[str], env: dict[str, str]) -> int:
    """The device memory `job` sees, run with /run/cgpu set up `how`."""
    stray = tmp_path / "stray"
    if not stray.exists():
        region_mod.Region.create(stray, "stray", [region_mod.GpuSpec(limit=OTHER, ctx_bytes=0)],
                                 gates_open=True).close()
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", SETUP,
                             "sh", str(stray), how, *job],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    words = dict(word.split("=", 1) for word in result.stdout.split() if "=" in word)
    return int(words["total"])


@pytest.mark.parametrize("how", ["copied", "empty"])
def test_a_job_uses_its_own_region_whatever_lies_at_run_cgpu(tmp_path: Path, how: str) -> None:
    job = [str(CGPU_RUN), "--no-tree", "--memsize", str(OWN), "--",
           str(CUWORKLOAD), "--alloc", "1MiB"]
    assert total_seen(tmp_path, how, job, job_env(tmp_path)) == OWN


def test_the_hook_s_mount_point_wins_over_the_job_s_region(tmp_path: Path) -> None:
    """What keeps a container in its region (an empty or forged CGPU_REGION cannot
    switch libcgpu off): the mount point at /run/cgpu/control."""
    job = [str(CGPU_RUN), "--no-tree", "--memsize", str(OWN), "--",
           str(CUWORKLOAD), "--alloc", "1MiB"]
    assert total_seen(tmp_path, "mounted", job, job_env(tmp_path)) == OTHER


@pytest.mark.parametrize(("how", "total"), [("copied", DEVICE), ("mounted", OTHER)])
def test_without_cgpu_region_only_a_mount_point_is_a_region(
        tmp_path: Path, how: str, total: int) -> None:
    env = job_env(tmp_path)
    env.update({"LD_PRELOAD": str(paths.libcgpu()), "LD_LIBRARY_PATH": str(paths.simgpu_dir()),
                "CGPU_REGION": ""})
    assert total_seen(tmp_path, how, [str(CUWORKLOAD), "--alloc", "1MiB"], env) == total
