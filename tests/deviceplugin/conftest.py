"""Fixtures that run the device plugin's test doubles (doubles.py)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cgpu_km.deviceplugin.allocation import GIB
from cgpu_km.deviceplugin.extender import ExtenderLink
from tests.deviceplugin.doubles import FakeSource, Harness, PluginClient, StubKubelet, t4_gpus


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short temporary directory: unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="cgpu-dp-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fake_source() -> FakeSource:
    """Four healthy T4s (15109 MiB each)."""
    return FakeSource(t4_gpus(4))


@pytest.fixture
def make_source() -> Callable[[int], FakeSource]:
    return lambda count: FakeSource(t4_gpus(count))


@pytest.fixture
def make_harness(sock_dir: Path) -> Iterator[Callable[..., Harness]]:
    """Start a plugin on a source (and unit size) of the test's choosing; stopped at teardown."""
    started: list[Harness] = []

    def start(
        source: FakeSource,
        unit_bytes: int = GIB,
        extender: ExtenderLink | None = None,
        cdi_device: str = "",
    ) -> Harness:
        started.append(Harness(sock_dir, source, unit_bytes, extender, cdi_device))
        return started[-1]

    yield start
    for h in started:
        h.close()


@pytest.fixture
def harness(make_harness: Callable[..., Harness], fake_source: FakeSource) -> Harness:
    """The plugin on four fake T4s in GiB units, registered with a stub kubelet."""
    return make_harness(fake_source)


@pytest.fixture
def plugin_client() -> PluginClient:
    return PluginClient()


@pytest.fixture
def stub_kubelet(sock_dir: Path) -> Iterator[StubKubelet]:
    """A started stub kubelet whose socket is `<sock_dir>/kubelet.sock`."""
    kubelet = StubKubelet(sock_dir)
    kubelet.start()
    yield kubelet
    kubelet.stop()
