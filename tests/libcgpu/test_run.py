"""`cgpu-run` on a real FUSE control tree and simgpu: registration, the limit
inside, exit status, signal forwarding, cleanup, bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.libcgpu.sandbox import Built

CGPU_RUN = str(Path(sys.executable).parent / "cgpu-run")
MiB = 1 << 20
UUIDS = ["GPU-11111111-2222-3333-4444-000000000000", "GPU-11111111-2222-3333-4444-000000000001"]


def run_env(built: Built, tmp_path: Path, root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "CGPU_SIMULATE": "1",
        "CGPU_KM_ROOT": str(root),
        "CGPU_REGION_DIR": str(tmp_path / "regions"),
        "SIMGPU_DEVICES": f"Tesla T4:15109MiB:{UUIDS[0]},Tesla T4:15109MiB:{UUIDS[1]}",
        "SIMGPU_STATE": str(tmp_path / "simgpu-state"),
        "SIMGPU_CONTEXT_MEM": str(100 * MiB),
        "LD_LIBRARY_PATH": str(built.simgpu_dir),
    })
    env.pop("LD_PRELOAD", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def test_limits_inside_and_cleanup(built: Built, control_tree: Path, tmp_path: Path) -> None:
    script = (
        f'cat {control_tree}/1/job1/memsize {control_tree}/1/job1/weight; '
        'test -f "$CGPU_REGION/control" && echo region; echo "$CUDA_VISIBLE_DEVICES"; '
        f'{built.workload} alloc {100 * MiB} alloc 1 info'
    )
    result = subprocess.run(
        [CGPU_RUN, "--gpu", "1", "--memsize", str(200 * MiB), "--weight", "2", "--name", "job1",
         "--", "sh", "-c", script],
        env=run_env(built, tmp_path, control_tree), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        str(200 * MiB), "2", "region", UUIDS[1],
        f"alloc {100 * MiB} rc=0",  # the context took the other 100 MiB
        "alloc 1 rc=2",
        f"info free=0 total={200 * MiB} rc=0",
    ]
    assert not (control_tree / "1" / "job1").exists()
    assert list((tmp_path / "regions").iterdir()) == []


def test_exit_status_is_the_command_s(built: Built, control_tree: Path, tmp_path: Path) -> None:
    result = subprocess.run([CGPU_RUN, "--no-tree", "--", "sh", "-c", "exit 7"],
                            env=run_env(built, tmp_path, control_tree), timeout=60)
    assert result.returncode == 7


def test_signals_are_forwarded_and_cleanup_runs(built: Built, control_tree: Path,
                                                tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [CGPU_RUN, "--gpu", "0", "--name", "sig1", "--", "sh", "-c", "echo up; exec sleep 60"],
        env=run_env(built, tmp_path, control_tree), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "up\n"
    assert (control_tree / "0" / "sig1").is_dir()
    assert (tmp_path / "regions" / "sig1" / "control").is_file()
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM
    print(f"cgpu-run ended {time.monotonic() - started:.2f} s after SIGTERM")
    assert not (control_tree / "0" / "sig1").exists()
    assert not (tmp_path / "regions" / "sig1").exists()


def job_processes(marker: str) -> list[int]:
    """Live processes whose command line holds `marker` (a job's own argument)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if marker.encode() in argv and stat.rsplit(")", 1)[1].split()[0] != "Z":
            found.append(int(entry.name))
    return found


def wait_gone(marker: str, timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := job_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def python_job(marker: str) -> list[str]:
    return [sys.executable, "-c", "import sys, time; print('up', flush=True); time.sleep(60)",
            marker]


def test_a_killed_cgpu_run_takes_its_job_along(built: Built, control_tree: Path,
                                               tmp_path: Path) -> None:
    """SIGKILL cannot be forwarded: the job dies with cgpu-run all the same."""
    marker = f"cgpu-run-job-{tmp_path.name}"
    proc = subprocess.Popen([CGPU_RUN, "--gpu", "0", "--name", "kill1", "--",
                             *python_job(marker)],
                            env=run_env(built, tmp_path, control_tree), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    with proc.stdout:
        assert proc.stdout.readline() == "up\n"
    assert job_processes(marker)
    proc.kill()
    proc.wait(timeout=10)
    assert wait_gone(marker) == []


@pytest.mark.parametrize("delay", [0.1, 0.2, 0.3, 0.45, 0.7])
def test_a_signal_while_starting_leaves_nothing_behind(built: Built, control_tree: Path,
                                                       tmp_path: Path, delay: float) -> None:
    """SIGTERM at some point of the start (interpreter, registration, region, the
    job's spawn): whatever was done is undone and no job is left running."""
    marker = f"cgpu-run-job-{tmp_path.name}"
    proc = subprocess.Popen([CGPU_RUN, "--gpu", "0", "--name", "early1", "--",
                             *python_job(marker)],
                            env=run_env(built, tmp_path, control_tree),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), err
    assert "Traceback" not in err
    assert wait_gone(marker) == []
    assert not (control_tree / "0" / "early1").exists()
    regions = tmp_path / "regions"
    assert not regions.exists() or list(regions.iterdir()) == []


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu", "5", "--", "true"], "no GPU 5"),
    (["--gpu", "0", "--name", "bad/name", "--", "true"], "bad container id"),
    (["--oom-script", "/x", "--", "true"], "--oom-script needs --egpu"),
    (["--gpu", "0", "--weight", "99", "--", "true"], "cannot register"),
], ids=["unknown-gpu", "bad-name", "oom-without-egpu", "bad-weight"])
def test_bad_input_registers_nothing(built: Built, control_tree: Path, tmp_path: Path,
                                     args: list[str], message: str) -> None:
    result = subprocess.run([CGPU_RUN, *args], env=run_env(built, tmp_path, control_tree),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2  # simgpu's notice at most, no traceback
    assert [p.name for p in (control_tree / "0").iterdir() if p.is_dir()] == []
    regions = tmp_path / "regions"
    assert not regions.exists() or list(regions.iterdir()) == []
