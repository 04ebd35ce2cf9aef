"""containerd 1.6 with cgpu-container-runtime as its runc binary (`ctr run
--runc-binary`, the runc v2 shim calls it as docker does), on a simulated host;
and the CRI runtime that `cgpu-node install` writes, as containerd reads it.
A private containerd per module: its own socket, root and state (CRI off)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cgpu_km.children import stop_child
from cgpu_km.container.oci.settings import CONFIG_ENV
from cgpu_km.node import cli
from tests.containers.conftest import Image
from tests.containers.helpers import (
    LIMIT_6_OF_15,
    NOTHING,
    WRAPPER,
    RecordingRunc,
    SimHost,
    missing,
)

pytestmark = [
    pytest.mark.skipif(missing("containerd", "ctr", "runc") is not None,
                       reason=f"{missing('containerd', 'ctr', 'runc')} is not installed "
                              "(apt-get install containerd)"),
]

CONFIG = """version = 2
root = "{folder}/root"
state = "{folder}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{folder}/containerd.sock"
"""


@dataclass
class Containerd:
    folder: Path
    process: subprocess.Popen[bytes]

    def ctr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ctr", "--address", str(self.folder / "containerd.sock"), *args],
                              capture_output=True, text=True, timeout=timeout)

    def check(self, *args: str) -> str:
        result = self.ctr(*args)
        assert result.returncode == 0, result.stderr
        return result.stdout

    def remove(self, name: str) -> None:
        self.ctr("task", "kill", "-s", "KILL", name)
        deadline = time.monotonic() + 15
        while self.ctr("task", "rm", name).returncode != 0 and time.monotonic() < deadline:
            if "not found" in self.ctr("task", "ls").stdout or name not in \
                    self.ctr("task", "ls").stdout:
                break
            time.sleep(0.1)
        self.ctr("container", "rm", name)


@pytest.fixture(scope="module")
def containerd(runtime_config: Path) -> Iterator[Containerd]:
    folder = Path(tempfile.mkdtemp(prefix="cgpu-ctrd-"))
    (folder / "config.toml").write_text(CONFIG.format(folder=folder))
    with (folder / "containerd.log").open("wb") as log:
        process = subprocess.Popen(["containerd", "--config", str(folder / "config.toml")],
                                   stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, CONFIG_ENV: str(runtime_config)})
    engine = Containerd(folder, process)
    try:
        deadline = time.monotonic() + 30
        while engine.ctr("version").returncode != 0:
            assert process.poll() is None, (folder / "containerd.log").read_text()
            assert time.monotonic() < deadline, "containerd did not start"
            time.sleep(0.1)
        yield engine
    finally:
        for name in engine.ctr("container", "ls", "-q").stdout.split():
            engine.remove(name)
        stop_child(process, 30)
        subprocess.run(["umount", "-R", "-l", str(folder)], capture_output=True, check=False)
        shutil.rmtree(folder, ignore_errors=True)


def test_ctr_with_the_wrapper_registers_limits_and_removes(
        containerd: Containerd, image: Image, sim: SimHost, tmp_path: Path,
        recording_runc: RecordingRunc) -> None:
    """With runc 1.1 the wrapper puts the hook at createRuntime; with a runc
    that has no `features`, at prestart."""
    rootfs = tmp_path / "rootfs"  # the hook writes into a rootfs: one of the test's own
    shutil.copytree(image.rootfs, rootfs, symlinks=True)
    name = "cgpu-ctr-" + os.urandom(4).hex()
    containerd.check("run", "-d", "--runc-binary", str(WRAPPER), "--rootfs",
                     "--env", "PATH=/bin:/usr/bin", "--env", "ALIYUN_COM_GPU_MEM_CONTAINER=6",
                     "--env", "ALIYUN_COM_GPU_MEM_DEV=15", "--env", "NVIDIA_VISIBLE_DEVICES=1",
                     str(rootfs), name, "sleep", "600")
    try:
        assert sim.registered() == {0: {}, 1: {name[:12]: LIMIT_6_OF_15}}
        out = containerd.check("task", "exec", "--exec-id", "smi", name, "nvidia-smi",
                               "--query-gpu=memory.total", "--format=csv,noheader")
        assert out == "6043 MiB\n"
    finally:
        containerd.remove(name)
    assert sim.registered() == NOTHING
    assert sim.leftovers() == []
    assert recording_runc.creates() == [recording_runc.expected()]


def test_installed_cri_runtime_is_what_containerd_reads(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    (etc / "containerd").mkdir(parents=True)
    original = b'version = 2\n\n# ours\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n  SystemdCgroup = true\n'  # noqa: E501
    (etc / "containerd" / "config.toml").write_bytes(original)
    state = tmp_path / "state"
    assert cli.main(["install", "--no-build", "--engines", "containerd", "--etc", str(etc),
                     "--bin-dir", str(tmp_path / "bin"), "--prefix", str(tmp_path / "opt"),
                     "--state-dir", str(state), "--no-services", "--docker-default"]) == 0
    dumped = subprocess.run(["containerd", "--config", str(etc / "containerd" / "config.toml"),
                             "config", "dump"], capture_output=True, text=True, timeout=60)
    assert dumped.returncode == 0, dumped.stderr
    text = dumped.stdout
    section = text[text.index('[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.cgpu]'):]
    section = section[:section.index('[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]')]  # noqa: E501
    assert 'runtime_type = "io.containerd.runc.v2"' in section
    assert f'BinaryName = "{tmp_path / "bin" / "cgpu-container-runtime"}"' in section
    assert "SystemdCgroup = true" in section  # copied from runc: the same cgroup driver
    assert 'default_runtime_name = "cgpu"' in text
    assert cli.main(["uninstall", "--state-dir", str(state)]) == 0
    assert (etc / "containerd" / "config.toml").read_bytes() == original
