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
from cgpu_km.tree.model import ControlTree
from cgpu_km.tree.plain import PlainTree

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



@pytest.fixture
def in_process(tmp_path: Path) -> Iterator[PlainTree]:
    """The same server driven step by step, so that a test places writes between its steps."""
    tree = PlainTree(tmp_path / "tree", ControlTree(1))
    fd = tree.start()
    try:
        yield tree
    finally:
        tree.close(fd)


def step(tree: PlainTree) -> None:
    """One turn of `PlainTree.serve`'s loop, without its FIFO."""
    if tree.scan_writes():
        tree.render()


def echo_keeping_the_stamp(path: Path, text: str) -> None:
    """Write as `echo` does, leaving the size and times as they were: what a
    kernel with a coarse clock shows for a write in the same tick."""
    before = path.stat()
    with path.open("w") as out:
        out.write(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_write_in_the_same_clock_tick_is_seen(in_process: PlainTree) -> None:
    policy = in_process.root / "0" / "policy"
    for value in (2, 3, 2):
        echo_keeping_the_stamp(policy, f"{value}\n")
        step(in_process)
        assert in_process.tree.read("0/policy") == f"{value}\n".encode()


def test_a_write_between_two_steps_is_not_written_over(in_process: PlainTree) -> None:
    policy = in_process.root / "0" / "policy"
    policy.write_text("2\n")
    assert in_process.scan_writes()
    policy.write_text("3\n")  # the next writer, before the tree renders the first write
    in_process.render()
    assert policy.read_text() == "3\n"
    step(in_process)
    assert in_process.tree.read("0/policy") == b"3\n"
    assert policy.read_text() == "3\n"


def test_a_write_into_a_new_container_before_its_watch_is_seen(in_process: PlainTree) -> None:
    in_process.command(b"add 0 job weight=2")
    in_process.render()
    (in_process.root / "0" / "job" / "weight").write_text("5\n")
    step(in_process)
    assert in_process.tree.read("0/free_weight") == b"11\n"
    assert (in_process.root / "0" / "free_weight").read_text() == "11\n"
