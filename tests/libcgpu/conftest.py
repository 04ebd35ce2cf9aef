"""Fixtures for libcgpu's tests: the built libraries, a C workload, a sandbox."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.libcgpu.sandbox import Built, Sandbox, build


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    if shutil.which("gcc") is None or shutil.which("make") is None:
        pytest.skip("gcc and make are needed to build the libraries")
    try:
        return build(tmp_path_factory.mktemp("workload"))
    except subprocess.CalledProcessError as error:
        pytest.fail(f"{' '.join(error.cmd)} failed:\n{error.stdout}{error.stderr}")


@pytest.fixture
def sandbox(built: Built, tmp_path: Path) -> Iterator[Sandbox]:
    box = Sandbox(built, tmp_path)
    yield box
    box.close()

