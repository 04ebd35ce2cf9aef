"""The mount-free control tree (`cgpu_km.tree.plain`): the same tree as plain files.

Driven the way its users drive it: `cgpu_km.tree.client` (cgpu-run, the daemon)
and shell `echo`/`cat`, against a real server process.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cgpu_km.tree import client as treefs

REPO = Path(__file__).resolve().parents[2]


def eventually(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    root = tmp_path / "tree"
    with subprocess.Popen(
        [sys.executable, "-m", "cgpu_km.tree.plain", "--root", str(root), "--gpus", "2",
         "--gpu-memory", f"{16 << 30},{16 << 30}"],
        cwd=REPO, stderr=subprocess.PIPE, text=True,
    ) as server:
        eventually(lambda: (root / "inst_ctl").exists() or server.poll() is not None)
        assert server.poll() is None, server.stderr.read() if server.stderr else ""
        try:
            yield root, server
        finally:
            if server.poll() is None:
                server.terminate()
                server.wait(timeout=10)


def test_layout_and_modes(plain: tuple[Path, subprocess.Popen[str]]) -> None:
    root, _ = plain
    assert stat.S_ISFIFO(os.lstat(root / "inst_ctl").st_mode)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "0", "1", "default_memsize", "inst_ctl", "upgrade", "version"]
    assert stat.S_IMODE((root / "0" / "policy").stat().st_mode) == 0o644
    assert stat.S_IMODE((root / "0" / "free_weight").stat().st_mode) == 0o444
    view = treefs.read_tree(root)
    assert [(g.index, g.policy, g.max_inst, g.free_weight) for g in view.gpus] == [
        (0, 1, 16, 16), (1, 1, 16, 16)]


def test_commands_through_the_fifo(plain: tuple[Path, subprocess.Popen[str]]) -> None:
    root, _ = plain
    treefs.inst_ctl(root, "add 1 job memsize=1000 weight=3")
    eventually(lambda: (root / "1" / "job" / "meminfo").exists())
    job = treefs.read_tree(root).gpus[1].containers["job"]
    assert (job.memsize, job.weight, job.free) == (1000, 3, 1000)
    assert treefs.read_int(root / "1" / "free_weight") == 13
    treefs.inst_ctl(root, "meminfo 1 job 42=400")
    eventually(lambda: "PID: 42 Mem: 400" in (root / "1" / "job" / "meminfo").read_text())
    assert (root / "1" / "job" / "meminfo").read_text() == "Free: 600\nPID: 42 Mem: 400\n"
    treefs.inst_ctl(root, "del job")
    eventually(lambda: not (root / "1" / "job").exists())
    assert treefs.read_int(root / "1" / "free_weight") == 16


def test_refused_command_is_logged_and_changes_nothing(
        plain: tuple[Path, subprocess.Popen[str]]) -> None:
    root, server = plain
    treefs.inst_ctl(root, "add 0 a weight=99")
    treefs.inst_ctl(root, "add 7 b")
    treefs.inst_ctl(root, "add 0 c")  # a good one after the bad ones
    eventually(lambda: (root / "0" / "c").exists())
    assert sorted(treefs.read_tree(root).gpus[0].containers) == ["c"]
    server.terminate()
    server.wait(timeout=10)
    assert server.stderr is not None
    errors = server.stderr.read()
    assert "add 0 a weight=99" in errors
    assert "Invalid argument" in errors
    assert "No such device" in errors


def test_shell_writes_apply_and_bad_ones_are_put_back(
        plain: tuple[Path, subprocess.Popen[str]]) -> None:
    root, _ = plain
    subprocess.run(["sh", "-c", f"echo 2 > {root}/0/policy"], check=True)
    eventually(lambda: treefs.read_tree(root).gpus[0].policy == 2)
    time.sleep(0.1)
    subprocess.run(["sh", "-c", f"echo 9 > {root}/0/policy"], check=True)
    eventually(lambda: (root / "0" / "policy").read_text() == "2\n")
    treefs.inst_ctl(root, "add 0 w weight=4")
    eventually(lambda: (root / "0" / "w").exists())
    treefs.write_node(root, "0/w/weight", 6)
    eventually(lambda: treefs.read_int(root / "0" / "free_weight") == 10)
    assert (root / "0" / "w" / "weight").read_text() == "6\n"


def test_exit_removes_the_tree(plain: tuple[Path, subprocess.Popen[str]]) -> None:
    root, server = plain
    treefs.inst_ctl(root, "add 0 gone")
    eventually(lambda: (root / "0" / "gone").exists())
    server.terminate()
    assert server.wait(timeout=10) == 0
    assert list(root.iterdir()) == []


def test_refuses_a_folder_with_other_files(tmp_path: Path) -> None:
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "precious").write_text("keep me")
    result = subprocess.run(
        [sys.executable, "-m", "cgpu_km.tree.plain", "--root", str(tmp_path / "tree")],
        cwd=REPO, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 1
    assert "not empty" in result.stderr
    assert (tmp_path / "tree" / "precious").read_text() == "keep me"
