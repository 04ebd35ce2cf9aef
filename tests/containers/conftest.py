"""Fixtures of the engine tests: the image, a simulated host, the runtime's configuration."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cgpu_km.container.oci.settings import CONFIG_ENV
from cgpu_km.container.oci.spec import START_STAGES
from cgpu_km.demo.dockerd import PrivateDocker
from cgpu_km.demo.image import build_rootfs, rootfs_tar
from tests.containers.helpers import IMAGE, WRAPPER, RecordingRunc, SimHost, built


@dataclass(frozen=True)
class Image:
    rootfs: Path
    tar: Path


@pytest.fixture(scope="session")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    if not built():
        pytest.skip("simgpu and libcgpu are not built (make build)")
    folder = tmp_path_factory.mktemp("image")
    build_rootfs(folder / "rootfs")
    (folder / "rootfs.tar").write_bytes(rootfs_tar(folder / "rootfs"))
    return Image(folder / "rootfs", folder / "rootfs.tar")


@pytest.fixture(scope="module")
def runtime_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the wrapper's configuration is (engines get it as CGPU_RUNTIME_CONFIG)."""
    return tmp_path_factory.mktemp("runtime") / "runtime.toml"


@pytest.fixture
def sim(control_tree: Path, tmp_path: Path, runtime_config: Path) -> SimHost:
    host = SimHost(tree=control_tree, folder=tmp_path)
    host.write_config(runtime_config)
    return host


@pytest.fixture(params=START_STAGES)
def recording_runc(request: pytest.FixtureRequest, sim: SimHost, tmp_path: Path,
                   runtime_config: Path) -> RecordingRunc:
    """The wrapper runs a RecordingRunc: runc 1.1 (createRuntime), then runc
    without `features` (prestart)."""
    runc = RecordingRunc.make(tmp_path, request.param)
    sim.write_config(runtime_config, (str(runc.path),))
    return runc


@pytest.fixture(scope="module")
def dockerd(image: Image, runtime_config: Path) -> Iterator[PrivateDocker]:
    engine = PrivateDocker(Path(tempfile.mkdtemp(prefix="cgpu-docker-")),
                           {"runtimes": {"cgpu": {"path": str(WRAPPER)}}},
                           env={CONFIG_ENV: str(runtime_config)})
    engine.start()
    try:
        engine.check("import", str(image.tar), IMAGE)
        yield engine
    finally:
        engine.stop()


@pytest.fixture
def docker(dockerd: PrivateDocker, sim: SimHost) -> Iterator[PrivateDocker]:
    """The engine, its containers removed after the test (before the tree goes)."""
    try:
        yield dockerd
    finally:
        dockerd.remove_containers()
