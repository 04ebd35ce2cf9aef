"""`CGPU_SIMULATE=1 cgpu-run ... -- prog` runs prog on simgpu with no
LD_LIBRARY_PATH from the user: prog finds libcuda.so.1 by soname."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cgpu_km import gpus, paths

CGPU_RUN = Path(sys.executable).parent / "cgpu-run"
LOAD = ("import ctypes; cuda = ctypes.CDLL('libcuda.so.1'); "
        "print('cuInit', cuda.cuInit(0))")


def test_simgpu_folder_goes_first_once() -> None:
    folder = Path("/opt/cgpu_km/simgpu")
    assert gpus.with_simgpu_libraries({}, folder)["LD_LIBRARY_PATH"] == str(folder)
    env = {"LD_LIBRARY_PATH": f"/a::{folder}:/b", "X": "1"}
    assert gpus.with_simgpu_libraries(env, folder) == {
        "LD_LIBRARY_PATH": f"{folder}:/a:/b", "X": "1"}


@pytest.mark.skipif(not (paths.simgpu_dir() / "libcuda.so.1").is_file()
                    or not paths.libcgpu().is_file(),
                    reason="simgpu and libcgpu are not built (make build)")
def test_program_finds_simgpu_without_ld_library_path(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items()
           if key not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "CGPU_SIMGPU_DIR")}
    env.update({"CGPU_SIMULATE": "1", "CGPU_REGION_DIR": str(tmp_path / "regions"),
                "SIMGPU_STATE": str(tmp_path / "state"), "SIMGPU_CONTEXT_MEM": "0"})
    result = subprocess.run([str(CGPU_RUN), "--no-tree", "--", sys.executable, "-c", LOAD],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "cuInit 0\n"
