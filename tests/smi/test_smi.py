"""cgpu-smi on a real FUSE tree in a known state, with the daemon's snapshot up, stale, gone."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cgpu_km.daemon.snapshot import Snapshot, write_snapshot

CGPU_SMI = str(Path(sys.executable).parent / "cgpu-smi")
UUID0 = "GPU-5e1d0f6a-0000-4000-8000-000000000000"
UUID1 = "GPU-5e1d0f6a-0000-4000-8000-000000000001"
REPO = Path(__file__).resolve().parents[2]


def smi_env(tmp_path: Path, nvml: bool = False) -> dict[str, str]:
    """NVML is simgpu: with two T4s when `nvml`, else unavailable (names unknown)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CGPU_", "SIMGPU_"))}
    env["CGPU_SIMULATE"] = "1"
    env["SIMGPU_STATE"] = str(tmp_path / "simgpu-state")
    env["SIMGPU_DEVICES"] = f"Tesla T4:15109MiB:{UUID0},Tesla T4:15109MiB:{UUID1}"
    env["CGPU_SIMGPU_DIR"] = str(REPO / "simgpu") if nvml else str(tmp_path / "no-simgpu")
    return env


def run_smi(root: Path, state: Path, *args: str, nvml: bool = False,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [CGPU_SMI, "--root", str(root), "--state-dir", str(state), *args],
        capture_output=True, text=True, timeout=30, env=smi_env(state.parent, nvml), check=False,
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


def table(output: str, first_header: str) -> list[list[str]]:
    """The body rows (cells stripped) of the table whose header starts with `first_header`."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith("| ") and line[2:].split("|")[0].strip() == first_header
                 and i + 1 < len(lines) and lines[i + 1].startswith("+="))
    rows = []
    for line in lines[start + 2:]:
        if line.startswith("+"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def gpu_table(output: str) -> list[list[str]]:
    return table(output, "GPU")


def container_table(output: str) -> list[list[str]]:
    return table(output.split("Containers:")[1], "GPU")


def process_table(output: str) -> list[list[str]]:
    return table(output.split("Processes:")[1], "GPU")


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


def publish(state: Path, snapshot: Snapshot, **changes: object) -> Snapshot:
    snapshot = dataclasses.replace(snapshot, **changes)  # type: ignore[arg-type]
    write_snapshot(snapshot, state / "snapshot.json")
    return snapshot


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_daemon_up_shows_live_figures(known_tree: Path, state: Path,
                                      known_snapshot: Snapshot) -> None:
    publish(state, known_snapshot, pid=os.getpid(), timestamp=time.time())
    out = run_smi(known_tree, state).stdout
    assert f"Daemon: running (pid {os.getpid()}, version 0.1.0, period 0.05 s)" in out
    assert f"Tree: {known_tree} (version 0.1.0)" in out
    assert gpu_table(out) == [
        ["0", "Tesla T4", "3072MiB / 15109MiB", "75%", "1 preemptive", "16", "10", "80%"],
        ["1", "Tesla T4", "- / 15109MiB", "-", "1 preemptive", "16", "15", "80%"],
    ]
    assert container_table(out) == [
        ["0", "abc123def456", "1", "2", "no", "20.0%", "25.0%", "-", "1536MiB / 6043MiB",
         "125.5s", "12.2s", "3", "2", "0"],
        ["0", "web", "2", "4", "yes", "80.0%", "50.0%", "-", "0MiB / 15109MiB",
         "40.0s", "0.5s", "0", "0", "0"],
        ["1", "train", "3", "1", "no", "50.0%", "0.0%", "50%", "0MiB / 15109MiB",
         "0.0s", "0.0s", "0", "0", "0"],
    ]
    assert process_table(out) == [
        ["0", "abc123def456", "4242", "1024MiB", "yes"],
        ["0", "abc123def456", "4243", "512MiB", "BYPASSED"],
    ]


def test_tree_changes_show_at_once(known_tree: Path, state: Path,
                                   known_snapshot: Snapshot) -> None:
    publish(state, known_snapshot, pid=os.getpid(), timestamp=time.time())
    (known_tree / "0" / "policy").write_text("4\n")
    (known_tree / "0" / "abc123def456" / "weight").write_text("5\n")
    rows = gpu_table(run_smi(known_tree, state).stdout)
    assert rows[0][4:7] == ["4 soft", "16", "7"]


def test_daemon_gone_shows_what_the_tree_knows(known_tree: Path, state: Path,
                                               known_snapshot: Snapshot) -> None:
    pid = dead_pid()
    publish(state, known_snapshot, pid=pid, timestamp=time.time())
    out = run_smi(known_tree, state).stdout
    assert f"Daemon: NOT RUNNING (pid {pid} is gone); showing what the control tree knows" in out
    # Identity from the stale snapshot; no live usage.
    assert gpu_table(out)[0] == ["0", "Tesla T4", "- / 15109MiB", "-", "1 preemptive", "16",
                                 "10", "80%"]
    assert container_table(out)[0] == ["0", "abc123def456", "1", "2", "no", "-", "-", "-",
                                       "1536MiB / 6043MiB", "-", "-", "-", "-", "-"]
    assert len(process_table(out)) == 2


def test_stale_snapshot_means_not_running(known_tree: Path, state: Path,
                                          known_snapshot: Snapshot) -> None:
    publish(state, known_snapshot, pid=os.getpid(), timestamp=time.time() - 60)
    out = run_smi(known_tree, state).stdout
    assert "Daemon: NOT RUNNING (its last snapshot is 60 s old)" in out
    assert container_table(out)[0][5] == "-"


def test_no_snapshot_names_from_nvml(known_tree: Path, state: Path) -> None:
    out = run_smi(known_tree, state, nvml=True).stdout
    assert f"Daemon: NOT RUNNING (no snapshot in {state})" in out
    assert [row[:3] for row in gpu_table(out)] == [["0", "Tesla T4", "- / 15109MiB"],
                                                   ["1", "Tesla T4", "- / 15109MiB"]]
    # A container with the whole device: its limit is the device's total.
    assert container_table(out)[1][8] == "0MiB / 15109MiB"


def test_no_snapshot_and_no_nvml(known_tree: Path, state: Path) -> None:
    out = run_smi(known_tree, state).stdout
    assert gpu_table(out)[1] == ["1", "-", "- / -", "-", "1 preemptive", "16", "15", "80%"]
    assert container_table(out)[2][8] == "0MiB / -"


def test_corrupt_snapshot_is_reported_not_fatal(known_tree: Path, state: Path) -> None:
    state.mkdir()
    (state / "snapshot.json").write_text("{not json")
    out = run_smi(known_tree, state).stdout
    assert "Daemon: NOT RUNNING (unreadable snapshot: snapshot: not JSON" in out
    assert len(container_table(out)) == 3


def test_list_gpus(known_tree: Path, state: Path, known_snapshot: Snapshot) -> None:
    publish(state, known_snapshot, pid=os.getpid(), timestamp=time.time())
    assert run_smi(known_tree, state, "-L").stdout == (
        f"GPU 0: Tesla T4 (UUID: {UUID0})\nGPU 1: Tesla T4 (UUID: {UUID1})\n")
    assert run_smi(known_tree, state, "-L", "-i", "1").stdout == (
        f"GPU 1: Tesla T4 (UUID: {UUID1})\n")


def test_json_has_the_same_data(known_tree: Path, state: Path,
                                known_snapshot: Snapshot) -> None:
    publish(state, known_snapshot, pid=os.getpid(), timestamp=time.time())
    view = json.loads(run_smi(known_tree, state, "--json").stdout)
    assert view["daemon"]["running"] is True
    assert view["daemon"]["pid"] == os.getpid()
    assert view["tree_root"] == str(known_tree)
    gpu0 = view["gpus"][0]
    assert (gpu0["uuid"], gpu0["memory_used_bytes"], gpu0["utilization"]) == (UUID0, 3 << 30, 0.75)
    abc = gpu0["containers"][0]
    assert abc["name"] == "abc123def456"
    assert abc["memory_limit_bytes"] == 6337173913
    assert abc["processes"] == [{"pid": 4242, "memory_bytes": 1 << 30, "managed": True},
                                {"pid": 4243, "memory_bytes": 512 << 20, "managed": False}]
    assert abc["target_share"] == 0.2
    only = json.loads(run_smi(known_tree, state, "--json", "-i", UUID1).stdout)
    assert [g["index"] for g in only["gpus"]] == [1]
    assert only["gpus"][0]["containers"][0]["util_limit"] == 50


def test_filter_by_index_list(known_tree: Path, state: Path) -> None:
    out = run_smi(known_tree, state, "-i", "1,0").stdout
    assert [row[0] for row in gpu_table(out)] == ["0", "1"]
    out = run_smi(known_tree, state, "-i", "1").stdout
    assert [row[0] for row in gpu_table(out)] == ["1"]
    assert [row[1] for row in container_table(out)] == ["train"]
    assert process_table(out) == [["(none)"]]


def test_unknown_gpu_is_a_clear_error(known_tree: Path, state: Path) -> None:
    result = run_smi(known_tree, state, "-i", "7", check=False)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "cgpu-smi: -i 7: no such GPU (GPUs: 0, 1)\n"


def test_missing_tree_is_a_clear_error(tmp_path: Path, state: Path) -> None:
    result = run_smi(tmp_path / "absent", state, check=False)
    assert result.returncode == 1
    assert result.stderr.startswith(f"cgpu-smi: cannot read the control tree at {tmp_path}")
    assert result.stdout == ""


@pytest.mark.parametrize("seconds", ["0", "-1", "x"])
def test_bad_loop_interval(control_tree: Path, state: Path, seconds: str) -> None:
    result = run_smi(control_tree, state, "-l", seconds, check=False)
    assert result.returncode == 2
    assert "-l" in result.stderr


def lines_until(process: subprocess.Popen[str], marker: str, count: int) -> list[str]:
    """stdout lines up to the `count`-th that holds `marker` (the loop is running)."""
    assert process.stdout is not None
    lines: list[str] = []
    watchdog = threading.Timer(30, process.kill)  # a silent loop fails, never hangs
    watchdog.start()
    try:
        while sum(marker in line for line in lines) < count:
            line = process.stdout.readline()
            assert line, f"cgpu-smi stopped after {len(lines)} lines"
            lines.append(line)
    finally:
        watchdog.cancel()
    return lines


def interrupt(process: subprocess.Popen[str]) -> tuple[str, str]:
    """Ctrl-C, as a terminal sends it; the loop's output after it."""
    process.send_signal(signal.SIGINT)
    try:
        out, err = process.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return out, err


def interactive() -> None:
    """In the child: SIGINT as an interactive shell leaves it. A job started in the
    background of a script (`make test &`) inherits SIGINT ignored, and Python then
    keeps it ignored: the loop would never see the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_loop_repeats_until_interrupted(known_tree: Path, state: Path) -> None:
    process = subprocess.Popen(
        [CGPU_SMI, "--root", str(known_tree), "--state-dir", str(state), "-l", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=smi_env(state.parent),
        preexec_fn=interactive,
    )
    lines_until(process, "cgpu-smi 0.1.0", 3)
    _, err = interrupt(process)
    assert (process.returncode, err) == (0, "")


def test_json_loop_prints_one_document_per_line(known_tree: Path, state: Path) -> None:
    process = subprocess.Popen(
        [CGPU_SMI, "--root", str(known_tree), "--state-dir", str(state), "--json", "-l", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=smi_env(state.parent),
        preexec_fn=interactive,
    )
    first = lines_until(process, "\n", 2)
    out, _ = interrupt(process)
    documents = [json.loads(line) for line in [*first, *out.splitlines()]]
    assert len(documents) >= 2
    assert all(d["daemon"]["running"] is False for d in documents)
