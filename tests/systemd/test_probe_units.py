"""What the units do when NVML cannot give the GPUs: `cgpu-daemon --module-params`
and `--count-gpus` fail with one line (no GPU, no library), and the ExecStart of
cgpu-kmod.service and cgpu-fuse.service, run as systemd runs it with stand-ins
for the programs, fails with its message instead of starting on defaults.

The same under a running systemd, with the real module: kmod/vm/node."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DAEMON = Path(sys.executable).parent / "cgpu-daemon"
SIMGPU = REPO / "simgpu"
needs_simgpu = pytest.mark.skipif(not (SIMGPU / "libnvidia-ml.so.1").exists(),
                                  reason="simgpu is not built (make build)")


def probe(tmp_path: Path, flag: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CGPU_SIMULATE": "1",
            "CGPU_SIMGPU_DIR": str(SIMGPU), "SIMGPU_STATE": str(tmp_path / "simgpu-state"),
            "SIMGPU_DEVICES": "Tesla T4:15109MiB,Tesla V100-SXM2-16GB:16160MiB"}
    return subprocess.run([str(DAEMON), flag], capture_output=True, text=True, timeout=60,
                          env={**base, **env}, check=False)


@needs_simgpu
def test_module_params_are_nvml_count_and_totals(tmp_path: Path) -> None:
    result = probe(tmp_path, "--module-params")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"gpus=2 gpu_mem={15109 << 20},{16160 << 20}\n"
    assert probe(tmp_path, "--count-gpus").stdout == "2\n"


@needs_simgpu
@pytest.mark.parametrize("flag", ["--module-params", "--count-gpus"])
def test_no_gpu_is_an_error_not_one_gpu(tmp_path: Path, flag: str) -> None:
    result = probe(tmp_path, flag, SIMGPU_VISIBLE_DEVICES="")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.splitlines()[-1] == "cgpu-daemon: NVML reports no GPUs"


@pytest.mark.parametrize("flag", ["--module-params", "--count-gpus"])
def test_no_nvml_library_is_an_error(tmp_path: Path, flag: str) -> None:
    result = probe(tmp_path, flag, CGPU_SIMGPU_DIR=str(tmp_path / "none"))
    assert (result.returncode, result.stdout) == (1, "")
    assert "simgpu NVML library not found" in result.stderr.splitlines()[-1]


def exec_start(unit: str) -> str:
    """The unit's `ExecStart=/bin/sh -c '...'` script, with systemd's `$$` unescaped."""
    text = (REPO / "systemd" / unit).read_text()
    match = re.search(r"^ExecStart=/bin/sh -c '(.*)'$", text, re.M)
    assert match, f"{unit}: ExecStart is not /bin/sh -c '...'"
    return match.group(1).replace("$$", "$")


def stand_ins(tmp_path: Path, probe_output: str, probe_status: int) -> dict[str, str]:
    """cgpu-daemon that prints `probe_output` and exits `probe_status`; modprobe and
    cgpu-fuse that record their arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    programs = {
        "cgpu-daemon": f"printf '{probe_output}'; echo 'cgpu-daemon: probe said so' >&2; "
                       f"exit {probe_status}",
        "modprobe": f'echo "modprobe $*" >> {calls}',
        "cgpu-fuse": f'echo "cgpu-fuse $*" >> {calls}',
    }
    for name, body in programs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {"/usr/local/bin/cgpu-daemon": str(bin_dir / "cgpu-daemon"),
            "/sbin/modprobe": str(bin_dir / "modprobe"),
            "/usr/local/bin/cgpu-fuse": str(bin_dir / "cgpu-fuse")}


def run_unit(unit: str, tmp_path: Path, probe_output: str, probe_status: int
             ) -> tuple[subprocess.CompletedProcess[str], str]:
    script = exec_start(unit)
    for real, fake in stand_ins(tmp_path, probe_output, probe_status).items():
        script = script.replace(real, fake)
    result = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True,
                            timeout=30, check=False)
    calls = tmp_path / "calls"
    return result, calls.read_text() if calls.exists() else ""


def test_kmod_unit_loads_with_the_probed_parameters(tmp_path: Path) -> None:
    result, calls = run_unit("cgpu-kmod.service", tmp_path, "gpus=2 gpu_mem=1,2\\n", 0)
    assert result.returncode == 0, result.stderr
    assert calls == "modprobe cgpu_km gpus=2 gpu_mem=1,2\n"


@pytest.mark.parametrize(("output", "status"), [("", 1), ("gpus=1\\n", 1), ("", 0)],
                         ids=["fails", "fails-after-printing", "prints-nothing"])
def test_kmod_unit_fails_without_parameters(tmp_path: Path, output: str, status: int) -> None:
    result, calls = run_unit("cgpu-kmod.service", tmp_path, output, status)
    assert result.returncode == 1
    assert calls == ""  # modprobe never ran: no load with the defaults
    assert result.stderr.splitlines() == [
        "cgpu-daemon: probe said so",
        "cgpu-kmod: no GPU count and memory from NVML (cgpu-daemon --module-params failed): "
        "cgpu_km not loaded"]


def test_fuse_unit_serves_the_probed_count(tmp_path: Path) -> None:
    result, calls = run_unit("cgpu-fuse.service", tmp_path, "2\\n", 0)
    assert result.returncode == 0, result.stderr
    assert calls == "cgpu-fuse --root /run/cgpu_km --gpus 2\n"


def test_fuse_unit_fails_without_a_count(tmp_path: Path) -> None:
    result, calls = run_unit("cgpu-fuse.service", tmp_path, "", 1)
    assert (result.returncode, calls) == (1, "")
    assert "cgpu-fuse: no GPU count from NVML" in result.stderr
