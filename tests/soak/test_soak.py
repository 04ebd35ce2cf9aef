"""A one-minute soak (`make soak` runs ten): churn, live writes and every fault kind on
a simulated 8-GPU node, with the soak's properties as assertions. Timings (how long
each fault took, recovery, the daemon's growth) are printed, never asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.attacks.node import missing
from tests.soak import figures, report
from tests.soak.runner import run_plan

SEED = 1
SECONDS = 60.0
JUDGED = 8.0  # seconds of steady windows, at least, for a GPU's share to be judged
# A minute holds a few such spans per GPU, on a host that also runs the churn and
# the faults: held to twice the long soak's target, which is printed beside.
HELD = 2 * figures.TARGET

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))


def test_a_minute_of_churn_and_faults_leaves_nothing_and_holds_every_limit(
        tmp_path: Path) -> None:
    _events, record = run_plan(SEED, SECONDS, 8, tmp_path)
    summary = report.summarize(record)
    print(report.table(summary))
    for line in report.write_outputs(record, summary, tmp_path):
        print(line)
    assert summary.started["docker"] > 0
    assert summary.started["runc"] > 0
    assert summary.probed > 0
    assert summary.broken == []
    assert {kind for kind, f in summary.faults.items() if f.count} == set(summary.faults)
    assert [f"{f.kind}: {f.note}" for f in record.faults
            if f.done is None and f.kind != "launch-kill"] == []
    assert summary.lost == 0
    assert summary.errors == []
    assert summary.hook_errors == []
    assert {k: v for k, v in summary.leftovers.items() if v} == {}
    # Shares, where they can be judged: each GPU's steady windows of one ratio (each at
    # least 4 s in which both workloads were busy all along, with no fault, restart,
    # write or churn on the GPU near), kernels summed, where they last 8 s or more in
    # all: within HELD of the policy's ratio (`make soak` holds every window to
    # TARGET). A single 4 s window is a few hundred kernels, a slice's worth of them
    # either way on a loaded host: on this 2-core host one in three such windows
    # missed by 6 to 8% (the table prints them), and a pooled GPU by 5.8% once.
    judged = figures.pooled(summary.windows, JUDGED)
    print(f"shares judged on {len(judged)} GPU-ratios of {JUDGED:g} s or more: "
          f"{ {key: round(e, 4) for key, e in judged.items()} }; beyond the soak's "
          f"target of {figures.TARGET:.0%}: "
          f"{ {key: round(e, 4) for key, e in judged.items() if abs(e) > figures.TARGET} }")
    assert {key: e for key, e in judged.items() if abs(e) > HELD} == {}
