"""Fixtures for libcgpu's tests: the built libraries, a C workload, a sandbox."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.libcgpu.sandbox import HERE, LIBCGPU, SIMGPU, Built, Sandbox


def _make(directory: Path) -> None:
    result = subprocess.run(["make", "-s", "-C", str(directory)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"make -C {directory.name} failed:\n{result.stdout}{result.stderr}")


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    if not (SIMGPU / "Makefile").exists():
        pytest.skip("simgpu is not in this checkout yet")
    if shutil.which("gcc") is None or shutil.which("make") is None:
        pytest.skip("gcc and make are needed to build the libraries")
    _make(SIMGPU)
    _make(LIBCGPU)
    out = tmp_path_factory.mktemp("workload") / "workload"
    subprocess.run(
        ["gcc", "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{LIBCGPU / 'include'}",
         "-o", str(out), str(HERE / "workload.c"), str(SIMGPU / "libcuda.so.1"), "-ldl"],
        check=True)
    return Built(libcgpu=LIBCGPU / "libcgpu.so", simgpu_dir=SIMGPU, workload=out)


@pytest.fixture
def sandbox(built: Built, tmp_path: Path) -> Iterator[Sandbox]:
    box = Sandbox(built, tmp_path)
    yield box
    box.close()

