"""podman 4.3 with cgpu-hook from the hooks directory that `cgpu-node install`
writes (`when: always`, the hook decides), on a simulated host: at
createRuntime, as the install picks for runc 1.1, and at prestart, as it
picks for runtimes without `features`. podman keeps
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

from cgpu_km.container.oci.spec import CREATE_RUNTIME, START_STAGES
from cgpu_km.node import cli, install
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
    start: str  # the stage of its start hook

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


@pytest.fixture(params=START_STAGES)
def podman(image: Image, sim: SimHost, tmp_path: Path, request: pytest.FixtureRequest,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Podman]:
    if request.param == CREATE_RUNTIME:
        assert install.podman_start_stage() == CREATE_RUNTIME  # runc 1.1 lists it
    else:
        monkeypatch.setattr(install, "podman_start_stage", lambda: request.param)
    etc = tmp_path / "etc"
    assert cli.main(["install", "--no-build", "--engines", "podman", "--etc", str(etc),
                     "--bin-dir", str(tmp_path / "bin"), "--prefix", str(tmp_path / "opt"),
                     "--state-dir", str(tmp_path / "state"), "--tree-root", str(sim.tree),
                     "--no-services", "--simulate", "on",
                     "--simgpu-state", str(sim.state), "--simgpu-devices", DEVICES,
                     *(f"--hook-env={pair}" for pair in sim.hook_env()[1:])]) == 0
    # podman refuses a runroot path longer than 50 characters.
    engine = Podman(Path(tempfile.mkdtemp(prefix="cgpu-podman-")),
                    etc / "containers" / "oci" / "hooks.d", request.param)
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
    assert hooks == sorted(["cgpu-poststop.json", f"cgpu-{podman.start}.json"])
    start = json.loads((podman.hooks_dir / f"cgpu-{podman.start}.json").read_text())
    assert start["when"] == {"always": True}
    assert start["stages"] == [podman.start]
    assert start["hook"]["args"][-1] == podman.start
    full_id = podman.check("run", "-d", "--network=none", *LIMITS, "--name", "gpu_test1",
                           "-e", "ALIYUN_COM_GPU_MEM_CONTAINER=6",
                           "-e", "ALIYUN_COM_GPU_MEM_DEV=15", "-e", "NVIDIA_VISIBLE_DEVICES=0",
                           IMAGE, "sleep", "600").strip()
    assert sim.registered() == {0: {full_id[:12]: LIMIT_6_OF_15}, 1: {}}
    # One call, at the start stage; podman keeps poststop hooks and runs them itself.
    config = podman.check("inspect", "--format", "{{.OCIConfigPath}}", "gpu_test1").strip()
    hooks = json.loads(Path(config).read_text())["hooks"]
    assert {stage: [h["args"][-1] for h in entries] for stage, entries in hooks.items()} == \
        {podman.start: [podman.start]}
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
