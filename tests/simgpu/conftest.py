"""Fixtures for simgpu tests: the built libraries and isolated simulated hosts (simhost.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.simgpu.simhost import SimHost

REPO = Path(__file__).resolve().parents[2]
SIMGPU = REPO / "simgpu"


@pytest.fixture(scope="session")
def simgpu_dir() -> Path:
    """Build simgpu once per session (make is incremental)."""
    proc = subprocess.run(["make", "-s", "-C", str(SIMGPU)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        pytest.fail(f"make -C simgpu failed:\n{proc.stdout}\n{proc.stderr}")
    return SIMGPU


@pytest.fixture
def sim(simgpu_dir: Path, tmp_path: Path) -> Iterator[SimHost]:
    """A fresh simulated host: a T4 and a V100 with a known UUID."""
    host = SimHost(
        state=tmp_path / "simgpu-state",
        devices=(
            "Tesla T4:15109MiB,"
            "Tesla V100-SXM2-16GB:16160MiB:GPU-00000000-1111-2222-3333-444444444444"
        ),
        lib_dir=simgpu_dir,
    )
    try:
        yield host
    finally:
        host.stop_all()
