"""`cgpu-node install` and `uninstall` on a node with a running dockerd: the
prefix built from this checkout (its own venv, offline), the runtime
registered while docker runs (SIGHUP reload), the name `nvidia` taken over
with the NVIDIA runtime behind it (a stand-in that logs its calls and runs
runc), the document's `docker run --runtime=nvidia` limited; then uninstall
restores every file byte for byte and docker reloads the old runtimes."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cgpu_km.container.oci.settings import CONFIG_ENV
from cgpu_km.demo.dockerd import PrivateDocker
from tests.containers.conftest import Image
from tests.containers.helpers import DEVICES, IMAGE, LIMIT_6_OF_15, NOTHING, SimHost, missing

pytestmark = [
    pytest.mark.skipif(missing("dockerd", "containerd", "runc") is not None,
                       reason=f"{missing('dockerd', 'containerd', 'runc')} is not installed "
                              "(apt-get install docker.io)"),
]

NODE = Path(sys.executable).parent / "cgpu-node"
FAKE_NVIDIA = """#!/bin/sh
echo "$*" >> {log}
exec runc "$@"
"""


def wait_until(what: str, ready: Callable[[], bool], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.1)


@pytest.fixture
def node(tmp_path: Path) -> Path:
    """A node's /etc with docker configured for NVIDIA's runtime (a stand-in)."""
    fake = tmp_path / "nvidia-container-runtime"
    fake.write_text(FAKE_NVIDIA.format(log=tmp_path / "nvidia.log"))
    fake.chmod(0o755)
    (tmp_path / "etc" / "docker").mkdir(parents=True)
    nvidia = json.dumps({"path": str(fake), "runtimeArgs": []})
    (tmp_path / "etc" / "docker" / "daemon.json").write_text(  # no newline at the end
        f'{{\n  "log-level": "warn",\n  "runtimes": {{"nvidia": {nvidia}}}\n}}')
    return tmp_path


@pytest.fixture
def dockerd(node: Path, sim: SimHost) -> Iterator[PrivateDocker]:
    engine = PrivateDocker(Path(tempfile.mkdtemp(prefix="cgpu-docker-")),
                           config_file=node / "etc" / "docker" / "daemon.json",
                           env={CONFIG_ENV: str(node / "etc" / "cgpu_km" / "runtime.toml")})
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(folder.rglob("*"))}


def test_install_register_nvidia_name_and_restore(
        node: Path, dockerd: PrivateDocker, sim: SimHost, image: Image) -> None:
    before = snapshot(node / "etc")
    assert dockerd.runtimes() == ["io.containerd.runc.v2", "io.containerd.runtime.v1.linux",
                                  "nvidia", "runc"]
    install = subprocess.run(
        [str(NODE), "install", "--prefix", str(node / "opt" / "cgpu_km"),
         "--bin-dir", str(node / "bin"), "--etc", str(node / "etc"),
         "--state-dir", str(node / "state"), "--engines", "docker,containerd,podman",
         "--nvidia-name", "--docker-pidfile", str(dockerd.pidfile), "--no-services",
         "--tree-root", str(sim.tree), "--simulate", "on", "--simgpu-state", str(sim.state),
         "--simgpu-devices", DEVICES, *(f"--hook-env={pair}" for pair in sim.hook_env()[1:])],
        capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    assert "dockerd (pid" in install.stdout
    assert (node / "bin" / "cgpu-hook").resolve() == \
        node / "opt" / "cgpu_km" / "venv" / "bin" / "cgpu-hook"
    wait_until("dockerd reloads", lambda: "cgpu" in dockerd.runtimes())

    dockerd.check("import", str(image.tar), IMAGE)
    dockerd.check("run", "-d", "-t", "--runtime=nvidia", "--network=none", "--name",
                  "gpu_test1", "-e", "ALIYUN_COM_GPU_MEM_CONTAINER=6",
                  "-e", "ALIYUN_COM_GPU_MEM_DEV=15", "-e", "NVIDIA_VISIBLE_DEVICES=0", IMAGE,
                  "sleep", "600")
    dockerid = dockerd.check("ps", "--format", "{{.ID}}").strip()
    assert sim.registered() == {0: {dockerid: LIMIT_6_OF_15}, 1: {}}
    assert "6043MiB" in dockerd.check("exec", "-i", "gpu_test1", "nvidia-smi")
    assert " create " in f" {(node / 'nvidia.log').read_text()} "  # NVIDIA's runtime ran it
    dockerd.check("rm", "-f", "gpu_test1")
    assert sim.registered() == NOTHING

    uninstall = subprocess.run([str(NODE), "uninstall", "--state-dir", str(node / "state")],
                               capture_output=True, text=True, timeout=120)
    assert uninstall.returncode == 0, uninstall.stderr
    assert snapshot(node / "etc") == before
    assert [name for name in ("bin", "opt", "state") if (node / name).exists()] == []
    wait_until("dockerd reloads", lambda: "cgpu" not in dockerd.runtimes())
    # `nvidia` is NVIDIA's runtime again: the same command runs without cgpu.
    dockerd.check("run", "--rm", "--runtime=nvidia", "--network=none",
                  "-e", "ALIYUN_COM_GPU_MEM_CONTAINER=6", IMAGE, "true")
    assert sim.registered() == NOTHING
