"""The FUSE tree, mounted for real and driven by a real shell."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cgpu_km.tree import client as treefs

REPO = Path(__file__).resolve().parents[2]
CONFORMANCE = REPO / "tests" / "conformance" / "conformance.sh"
BUSYBOX = shutil.which("busybox")
pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse")


def sh(script: str, root: Path, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    shell = [BUSYBOX, "sh"] if BUSYBOX else ["sh"]
    return subprocess.run(
        [*shell, "-c", script], cwd=root, text=True, capture_output=True, check=check, timeout=120
    )


@pytest.mark.parametrize("control_tree", [1, 2, 4], indirect=True)
def test_conformance_suite_passes_through_the_mount(control_tree: Path) -> None:
    shell = [BUSYBOX, "sh"] if BUSYBOX else ["sh"]
    result = subprocess.run(
        [*shell, str(CONFORMANCE)], env={**os.environ, "CGPU_KM_ROOT": str(control_tree)},
        text=True, capture_output=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.endswith(" 0 failed"), summary
    passed = int(summary.split()[1])
    assert passed > 250, summary


def test_echo_and_cat_drive_the_tree(control_tree: Path) -> None:
    out = sh("echo 3 > 0/policy && cat 0/policy && echo 'add 1 web weight=2' > inst_ctl "
             "&& cat 1/free_weight && ls 1", control_tree).stdout
    assert out.split() == ["3", "14", "free_weight", "major", "max_inst", "policy",
                           "prio_ratio", "web"]
    failed = sh("echo 9 > 0/policy", control_tree, check=False)
    assert failed.returncode != 0
    assert "Invalid argument" in failed.stderr


def test_tree_client_reads_what_the_shell_wrote(control_tree: Path) -> None:
    treefs.inst_ctl(control_tree, "add 0 job memsize=4096 weight=3 highprio=1")
    treefs.inst_ctl(control_tree, "meminfo 0 job 42=1000")
    treefs.write_node(control_tree, "0/policy", 4)
    view = treefs.read_tree(control_tree)
    assert view.version.count(".") == 2
    assert [g.index for g in view.gpus] == [0, 1]
    gpu = view.gpus[0]
    assert (gpu.policy, gpu.free_weight) == (4, 13)
    job = gpu.containers["job"]
    assert (job.memsize, job.weight, job.highprio, job.free, job.procs) == (
        4096, 3, 1, 3096, {42: 1000})
    with pytest.raises(OSError, match="File exists"):
        treefs.inst_ctl(control_tree, "add 0 job")


def test_deleted_container_is_gone_at_once(control_tree: Path) -> None:
    out = sh("i=0; while [ $i -lt 20 ]; do echo \"add 0 c$i\" > inst_ctl; "
             "test -e 0/c$i || echo missing; echo \"del 0 c$i\" > inst_ctl; "
             "test -e 0/c$i && echo stale; test -e 0/c$i/weight && echo stale; i=$((i+1)); done",
             control_tree).stdout
    assert out == ""


def test_values_read_whole_with_sendfile_and_by_size(control_tree: Path) -> None:
    treefs.inst_ctl(control_tree, "add 0 c memsize=123456789")
    treefs.inst_ctl(control_tree, "meminfo 0 c " + " ".join(f"{p}=1" for p in range(1, 200)))
    path = control_tree / "0" / "c" / "meminfo"
    expected = "Free: 123456590\n" + "".join(f"PID: {p} Mem: 1\n" for p in range(1, 200))
    assert path.read_text() == expected  # Python reads by st_size first
    assert sh("cat 0/c/meminfo", control_tree).stdout == expected  # busybox cat: sendfile
    assert path.stat().st_size > 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_unmounts_cleanly(mounted_tree: object, signum: int) -> None:
    tree = mounted_tree
    tree.process.send_signal(signum)  # type: ignore[attr-defined]
    assert tree.process.wait(timeout=10) == 0  # type: ignore[attr-defined]
    assert not os.path.ismount(tree.root)  # type: ignore[attr-defined]


def test_bad_options_fail_with_a_message(tmp_path: Path) -> None:
    result = subprocess.run(
        [shutil.which("cgpu-fuse") or str(Path(sys.executable).parent / "cgpu-fuse"),
         "--root", str(tmp_path / "m"), "--policy", "9"],
        text=True, capture_output=True, timeout=30,
    )
    assert result.returncode == 2
    assert "policy must be 0..5" in result.stderr
    assert not os.path.ismount(tmp_path / "m")


def test_concurrent_shell_writers_lose_nothing(control_tree: Path) -> None:
    """Many shells hammer the same nodes; the tree stays consistent and complete."""
    writers = []
    for w in range(8):
        script = (
            f"i=0; while [ $i -lt 25 ]; do "
            f"echo 'add 0 w{w}-'$i > inst_ctl; echo $((i % 6)) > 0/policy; "
            f"echo 1 > 0/w{w}-$i/weight 2>/dev/null; "
            f"if [ $((i % 2)) -eq 0 ]; then echo 'del 0 w{w}-'$i > inst_ctl; fi; "
            f"cat 0/free_weight > /dev/null; i=$((i+1)); done"
        )
        shell = [BUSYBOX, "sh"] if BUSYBOX else ["sh"]
        writers.append(subprocess.Popen([*shell, "-c", script], cwd=control_tree))
    treefs.write_node(control_tree, "0/max_inst", 25)
    for writer in writers:
        assert writer.wait(timeout=120) == 0
    view = treefs.read_tree(control_tree)
    names = set(view.gpus[0].containers)
    # Each writer keeps its odd-numbered containers, as many as max_inst allows.
    assert all(name.split("-")[1].isdigit() and int(name.split("-")[1]) % 2 for name in names)
    assert len(names) == min(view.gpus[0].max_inst, len(names))
    weights = sum(c.weight for c in view.gpus[0].containers.values())
    assert view.gpus[0].free_weight == view.gpus[0].max_inst - weights
    ids = [c.id for c in view.gpus[0].containers.values()]
    assert len(set(ids)) == len(ids)
    assert 0 <= view.gpus[0].policy <= 5
