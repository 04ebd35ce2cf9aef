"""podman 4.3 with cgpu-hook from the hooks directory that `cgpu-node install`
writes (`when: always`, the hook decides), on a simulated host. podman keeps
its storage in a temporary folder (--root, --runroot); this machine's hard
limits are below podman's defaults, hence the --ulimit options."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cgpu_km.node import cli
from tests.containers.conftest import Image
from tests.containers.helpers import DEVICES, IMAGE, LIMIT_6_OF_15, NOTHING, SimHost, missing

pytestmark = [
    pytest.mark.skipif(missing("podman", "runc") is not None,
                       reason=f"{missing('podman', 'runc')} is not installed "
                              "(apt-get install podman)"),
]

LIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]


@dataclass
class Podman:
    folder: Path
    hooks_dir: Path

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        podman = shutil.which("podman")
        assert podman is not None
        command = [podman, "--root", str(self.folder / "root"), "--runroot",
                   str(self.folder / "run"), "--tmpdir", str(self.folder / "tmp"),
                   "--hooks-dir", str(self.hooks_dir), "--cgroup-manager", "cgroupfs",
                   "--events-backend", "file", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)

    def check(self, *args: str) -> str:
        result = self(*args)
        assert result.returncode == 0, result.stderr
        return result.stdout


@pytest.fixture
def podman(image: Image, sim: SimHost, tmp_path: Path) -> Iterator[Podman]:
    etc = tmp_path / "etc"
    assert cli.main(["install", "--no-build", "--engines", "podman", "--etc", str(etc),
                     "--bin-dir", str(tmp_path / "bin"), "--prefix", str(tmp_path / "opt"),
                     "--state-dir", str(tmp_path / "state"), "--tree-root", str(sim.tree),
                     "--no-services", "--simulate", "on",
                     "--simgpu-state", str(sim.state), "--simgpu-devices", DEVICES,
                     *(f"--hook-env={pair}" for pair in sim.hook_env()[1:])]) == 0
    # podman refuses a runroot path longer than 50 characters.
    engine = Podman(Path(tempfile.mkdtemp(prefix="cgpu-podman-")),
                    etc / "containers" / "oci" / "hooks.d")
    try:
        engine.check("import", str(image.tar), IMAGE)
        yield engine
    finally:
        ids = engine("ps", "-aq").stdout.split()
        if ids:
            engine("rm", "-f", "-t", "0", *ids)
        engine("system", "reset", "--force")
        shutil.rmtree(engine.folder, ignore_errors=True)
        assert cli.main(["uninstall", "--state-dir", str(tmp_path / "state")]) == 0


def test_hooks_register_while_running_and_remove(podman: Podman, sim: SimHost) -> None:
    hooks = sorted(p.name for p in podman.hooks_dir.iterdir())
    assert hooks == ["cgpu-poststop.json", "cgpu-prestart.json"]
    assert json.loads((podman.hooks_dir / "cgpu-prestart.json").read_text())["when"] == \
        {"always": True}
    full_id = podman.check("run", "-d", "--network=none", *LIMITS, "--name", "gpu_test1",
                           "-e", "ALIYUN_COM_GPU_MEM_CONTAINER=6",
                           "-e", "ALIYUN_COM_GPU_MEM_DEV=15", "-e", "NVIDIA_VISIBLE_DEVICES=0",
                           IMAGE, "sleep", "600").strip()
    assert sim.registered() == {0: {full_id[:12]: LIMIT_6_OF_15}, 1: {}}
    assert podman.check("exec", "gpu_test1", "cat", "/etc/ld.so.preload") == \
        "/usr/local/lib/cgpu/libcgpu.so\n"
    podman.check("rm", "-f", "-t", "0", "gpu_test1")
    assert sim.registered() == NOTHING
    assert sim.leftovers() == []


def test_plain_container_and_bad_env(podman: Podman, sim: SimHost) -> None:
    assert podman.check("run", "--rm", "--network=none", *LIMITS, IMAGE, "echo", "hi") == "hi\n"
    result = podman("run", "--rm", "--network=none", *LIMITS,
                    "-e", "ALIYUN_COM_GPU_MEM_CONTAINER=3", "-e", "ALIYUN_COM_GPU_MEM_DEV=0",
                    IMAGE, "true")
    assert result.returncode != 0
    assert "cgpu-hook: ALIYUN_COM_GPU_MEM_DEV: must be above 0" in result.stderr, result.stderr
    assert sim.registered() == NOTHING
    assert sim.leftovers() == []
