"""tools/tiers.sh, `make test`'s runner: one verdict per tier, from the tier's
exit status and pytest's summary, run with a fake `make` (and `id`)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIERS = REPO / "tools" / "tiers.sh"

FAKE_MAKE = """#!/bin/sh
# make --no-print-directory test-TIER: print out/TIER, exit with rc/TIER (else 0)
tier=${2#test-}
cat "$FAKE/out/$tier"
exit "$(cat "$FAKE/rc/$tier" 2>/dev/null || echo 0)"
"""
FAKE_ID = """#!/bin/sh
echo "$FAKE_UID"
"""


def run_tiers(tmp_path: Path, uid: int,
              **tiers: tuple[str, int]) -> subprocess.CompletedProcess[str]:
    """tools/tiers.sh over `tiers`: name -> (what its make prints, its exit status)."""
    for folder in ("bin", "out", "rc"):
        (tmp_path / folder).mkdir(exist_ok=True)
    for name, text in (("make", FAKE_MAKE), ("id", FAKE_ID)):
        (tmp_path / "bin" / name).write_text(text)
        (tmp_path / "bin" / name).chmod(0o755)
    for tier, (output, status) in tiers.items():
        (tmp_path / "out" / tier).write_text(output)
        (tmp_path / "rc" / tier).write_text(f"{status}\n")
    env = {**os.environ, "FAKE": str(tmp_path), "FAKE_UID": str(uid),
           "MAKE": str(tmp_path / "bin" / "make"),
           "PATH": f"{tmp_path / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    return subprocess.run(["sh", str(TIERS), *tiers], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def verdicts(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """tier -> its line's verdict ("ok", "skipped", "FAILED (exit N)")."""
    lines = [line for line in result.stdout.splitlines() if line.startswith("tier ")]
    return {line.split()[1].rstrip(":"): line.split(": ", 1)[1].split(", wall")[0]
            for line in lines}


PASSED = ("....\n4 passed, 1 skipped in 0.50s\n", 0)
ALL_SKIPPED = ("sss\nSKIPPED [3] tests/x/test_a.py:7: integration tier: needs root\n"
               "3 skipped, 9 deselected in 0.10s\n", 0)
NONE_COLLECTED = ("\n9 deselected in 0.02s\nmake: *** [Makefile:1: test-x] Error 5\n", 2)
SYSTEM = ("run-vm: PASS\nnode-vm: PASS\n", 0)


def test_a_tier_that_ran_no_test_is_skipped_not_ok(tmp_path: Path) -> None:
    result = run_tiers(tmp_path, 1000, unit=PASSED, integration=ALL_SKIPPED,
                       other=NONE_COLLECTED, system=SYSTEM)
    assert verdicts(result) == {"unit": "ok", "integration": "skipped", "other": "skipped",
                                "system": "ok"}, result.stdout
    assert "3 skipped, 9 deselected in 0.10s; tests/x/test_a.py:7: integration tier: needs root" \
        in result.stdout, "a skipped tier says why"
    assert result.stdout.splitlines()[-1] == "2 passed, 2 skipped, 0 failed"
    assert result.returncode == 0, "skipping as a normal user is no failure"
    assert (tmp_path / "build" / "tiers" / "integration.log").read_text() == ALL_SKIPPED[0]


def test_a_root_run_fails_when_a_tier_was_skipped(tmp_path: Path) -> None:
    result = run_tiers(tmp_path, 0, unit=PASSED, integration=ALL_SKIPPED)
    assert verdicts(result) == {"unit": "ok", "integration": "skipped"}
    assert result.returncode != 0
    assert "skipped on a run as root" in result.stderr
    assert run_tiers(tmp_path, 0, unit=PASSED, system=SYSTEM).returncode == 0


def test_failures_are_failures_whatever_ran(tmp_path: Path) -> None:
    failing = ("F.\n= 1 failed, 1 passed in 0.20s =\n", 2)
    errors = ("E\n1 error in 0.30s\n", 2)
    result = run_tiers(tmp_path, 1000, unit=failing, integration=errors,
                       system=("run-vm: FAIL\n", 1))
    assert verdicts(result) == {"unit": "FAILED (exit 2)", "integration": "FAILED (exit 2)",
                                "system": "FAILED (exit 1)"}
    assert re.search(r"^tier unit: FAILED \(exit 2\), wall \d+ s: 1 failed, 1 passed in 0.20s$",
                     result.stdout, re.MULTILINE), result.stdout
    assert result.stdout.splitlines()[-1] == "0 passed, 0 skipped, 3 failed"
    assert result.returncode != 0
