"""The differential test's script on the FUSE tree, and its own sanity.

The kernel-module VM test runs the same generated script on /proc/cgpu_km
(kmod/vm/run-vm.sh); here it runs on a real FUSE mount with busybox sh, so
both trees are held to the same model with the same harness.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests.kmod import difftest

COUNT = difftest.DEFAULT_COUNT


def test_operations_reach_every_outcome() -> None:
    lines = difftest.expected(difftest.generate(count=difftest.DEFAULT_COUNT))
    outcomes = Counter(
        line.split(" ", 2)[1] if " ERR " not in line else line.split()[-1] for line in lines
    )
    for outcome in (
        "OK",
        "=",
        "D",
        "EINVAL",
        "ENOENT",
        "EEXIST",
        "ENODEV",
        "ENOSPC",
        "EPERM",
        "EBUSY",
    ):
        assert outcomes[outcome] > 0, (outcome, outcomes)


def test_compare_reports_a_difference() -> None:
    ops = difftest.generate(count=30)
    want = difftest.expected(ops)
    assert difftest.compare(want, want) == []
    changed = [*want[:-1], want[-1] + "x"]
    assert difftest.compare(want, changed, ops)
    assert difftest.compare(want, want[:-1])
    log = "\n".join(["noise", difftest.BEGIN, *want, difftest.END, "more"])
    assert difftest.extract(log) == want


def test_fuse_tree_agrees_with_the_model(control_tree: Path, tmp_path: Path) -> None:
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox is not installed")
    ops = difftest.generate(count=COUNT)
    script = tmp_path / "difftest.sh"
    script.write_text(difftest.shell_script(ops))
    env = {**os.environ, "CGPU_KM_ROOT": str(control_tree), "LC_ALL": "C"}
    run = subprocess.run(
        [busybox, "sh", str(script)],
        env=env,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=240,
        check=False,
    )
    got = difftest.extract(run.stdout)
    problems = difftest.compare(difftest.expected(ops, gpu_memory=()), got, ops)
    assert not problems, "\n".join(problems) + "\n" + run.stderr[-2000:]
