"""A control tree in a known state, matching the known snapshot of tests/metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgpu_km.daemon.snapshot import Snapshot
from cgpu_km.tree import client as treefs

KNOWN_SNAPSHOT = Path(__file__).resolve().parents[1] / "metrics" / "known_snapshot.json"


@pytest.fixture
def known_snapshot() -> Snapshot:
    return Snapshot.from_json(KNOWN_SNAPSHOT.read_text())


@pytest.fixture
def known_tree(control_tree: Path) -> Path:
    """Three containers (ids 1-3) on two GPUs, as in the known snapshot."""
    for command in (
        "add 0 abc123def456 memsize=6337173913 weight=2",
        "add 0 web weight=4 highprio=1",
        "add 1 train util_limit=50",
        "meminfo 0 abc123def456 4242=1073741824 4243=536870912",
    ):
        treefs.inst_ctl(control_tree, command)
    return control_tree
