"""`tests/gpu/validate.sh --simulate`: the real-GPU validation, every step on simgpu.

The script must not rot between the rare runs on an NVIDIA GPU: this runs it
whole (build, control tree, daemon, memory, compute under policies 2/1/5,
overhead, two latency rows, the compute check) and checks what it prints.
Bounds are generous (a small shared host); the real accuracy bar is checked on
the GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "gpu" / "validate.sh"
ROW = re.compile(r"^\|\s+(\d+) \|\s+([\d.]+) \|\s+([\d.]+) \|\s+1:([\d.]+) \|"
                 r"[^|]*\|\s*([^|]*?)\s*\|")


def run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("VALIDATE_", "CGPU_"))}
    full.update(TMPDIR=str(tmp_path), OUT=str(tmp_path / "out"), **env)
    return subprocess.run(["bash", str(SCRIPT), "--simulate"], env=full, capture_output=True,
                          text=True, timeout=280, cwd=tmp_path, check=False)


def saved_log(out: Path, name: str) -> str:
    """One log from the run's validate-logs.tar.gz ("" when it is not there)."""
    with tarfile.open(out / "validate-logs.tar.gz") as saved:
        for member in saved.getmembers():
            if member.name.endswith(name) and (handle := saved.extractfile(member)):
                return handle.read().decode(errors="replace")
    return ""


def tables(stdout: str) -> dict[int, dict[int, float]]:
    """policy -> batch -> measured ratio (weight 2 over weight 1), from the printed tables;
    a window an audit fell in is left out (the harness does not judge it either)."""
    found: dict[int, dict[int, float]] = {}
    policy = None
    for line in stdout.splitlines():
        heading = re.match(r"### 2\. Compute: policy (\d)", line)
        if heading:
            policy = int(heading.group(1))
            found[policy] = {}
        elif line.startswith("### "):
            policy = None
        elif (policy is not None and (row := ROW.match(line))
              and not row.group(5).startswith("void: audited")):
            found[policy][int(row.group(1))] = float(row.group(4))
    return found


@pytest.mark.timeout(300)
def test_simulated_validation_runs_every_section(tmp_path: Path) -> None:
    result = run(tmp_path)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-2000:]
    for heading in ("### 1. Memory", "### 2. Compute: policy 2", "### 2. Compute: policy 1",
                    "### 2. Compute: policy 5", "### 3. Overhead", "### 4. Latency",
                    "### 5. The compute check"):
        assert heading in out, out[-3000:]
    assert "BROKEN" not in out
    assert "PASS memory: allocates up to the limit, out of memory beyond it" in out
    assert "PASS memory: daemon meminfo equals NVML's per-process usage" in out
    ratios = tables(out)
    compute = out[out.index("### 2. Compute"):out.index("### 3. Overhead")]
    audits = [line for line in saved_log(tmp_path / "out", "logs/daemon.log").splitlines()
              if ": audited for " in line]
    seen = "\n".join([compute, *audits])  # a message pytest prints whole
    for policy, target in ((2, 2.0), (1, 1.0)):
        # Honest containers are audited now and then (an audit voids its window): at
        # least three of the five windows are judged.
        assert len(ratios[policy]) >= 3, f"policy {policy}: too few judged\n{seen}"
        assert set(ratios[policy]) <= {1, 16, 32, 64, 128}, seen
        for batch, ratio in ratios[policy].items():
            assert ratio == pytest.approx(target, rel=0.10), f"{policy} {batch}\n{seen}"
    # each latency row under no scheduler and policies 1, 2, 4, every request timed
    for row in ("one busy", "single 50 ms kernels"):
        for sched in ("none", "policy 1", "policy 2", "policy 4"):
            line = re.search(rf"^{row} +{sched} +\|.*\| +(\d+) +[\d.]+%", out, re.MULTILINE)
            assert line is not None, (row, sched, out[-3000:])
            assert int(line.group(1)) >= 50, (row, sched, line.group(0))
    assert re.search(r"^(PASS|FAIL) latency: worst interactive p99", out, re.MULTILINE)
    saved = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert saved == ["checks.txt", "procaddr.txt", "tables.md", "validate-logs.tar.gz",
                     "validate.txt"]
    assert re.search(r"^PASS lookups: driver \d+, \d+ queries", out, re.MULTILINE), out[-3000:]
    assert "### 3. Overhead" in (tmp_path / "out" / "tables.md").read_text()
    # the daemon's compute check stopped no honest process, and stops the attacker
    assert "PASS detector: judged 0 processes in the honest sections" in out, out[-3000:]
    assert "PASS detector: the process that launched past the gate was judged" in out


@pytest.mark.timeout(200)
def test_mount_free_tree_fallback_carries_the_daemon(tmp_path: Path) -> None:
    result = run(tmp_path, CGPU_VALIDATE_TREE="plain", VALIDATE_BATCHES="32",
                 VALIDATE_POLICIES="2", VALIDATE_LATENCY_ROWS="one busy")
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-2000:]
    assert "control tree: plain files at" in out
    assert "PASS memory: daemon meminfo equals NVML's per-process usage" in out
    assert tables(out)[2][32] == pytest.approx(2.0, rel=0.10), out[-3000:]
    assert "### 3. Overhead" in out
    assert re.search(r"^one busy +policy 2 +\|", out, re.MULTILINE), out[-3000:]
