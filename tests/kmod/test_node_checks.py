"""The whole-node VM test's own arithmetic (kmod/vm/node/checks.py), which decides
its share and gate checks: windows of sharework's buckets, the first kernel after
an event, ratio errors. The VM itself runs in `make -C kmod node-test`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from cgpu_km.dataplane import region as region_mod

CHECKS = Path(__file__).resolve().parents[2] / "kmod" / "vm" / "node" / "checks.py"


@pytest.fixture(scope="module")
def checks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("node_checks", CHECKS)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["node_checks"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


OUTPUT = """ready pid=7 procs=1
counts t0=100.000000000 bucket_ms=10 seconds=0.05 procs=1 kernels=9 per_proc=9
buckets 0 0 4 0 5
"""


def test_report_windows(checks: ModuleType) -> None:
    report = checks.parse_report(OUTPUT)
    assert (report.t0, report.bucket, report.buckets) == (100.0, 0.01, (0, 0, 4, 0, 5))
    assert report.count(100.0, 100.05) == 9
    assert report.count(100.0, 100.02) == 0  # only whole buckets inside the window
    assert report.count(100.025, 100.05) == 5  # the bucket at 100.02 starts before it
    assert report.count(99.0, 101.0) == 9
    assert report.first_after(100.0) == pytest.approx(100.03)  # the end of its bucket
    assert report.first_after(100.031) == pytest.approx(100.05)
    assert report.first_after(100.05) is None


def test_report_without_counts_fails(checks: ModuleType) -> None:
    with pytest.raises(checks.Abort, match="no counts"):
        checks.parse_report("ready pid=7 procs=1\n")


def test_ratio_error(checks: ModuleType) -> None:
    assert checks.ratio_error(100, 200, 0.5) == 0
    assert checks.ratio_error(110, 200, 0.5) == pytest.approx(0.1)
    assert checks.ratio_error(1, 0, 2.0) == float("inf")


def test_samples_match_on_labels(checks: ModuleType) -> None:
    samples = {'cgpu_container_weight{gpu="0",uuid="u",container="a"}': 4.0,
               'cgpu_container_weight{gpu="0",uuid="u",container="ab"}': 2.0}
    assert checks.sample(samples, "cgpu_container_weight", container="ab") == 2.0
    assert checks.sample(samples, "cgpu_container_weight", container="a") == 4.0
    assert checks.sample(samples, "cgpu_container_weight", container="b") is None


def test_failed_open_reads_the_region_as_libcgpu_lays_it_out(checks: ModuleType,
                                                              tmp_path: Path) -> None:
    gpus = [region_mod.GpuSpec(1 << 30), region_mod.GpuSpec(1 << 30)]
    with region_mod.Region.create(tmp_path / "job", "job", gpus) as region:
        assert checks.failed_open(tmp_path / "job") is None
        account = region._account
        for index, gpu in ((3, 1), (5, 1), (6, 0)):
            slot = account.proc[index]
            slot.state = region_mod.SLOT_LIVE
            line = slot.gpu[gpu]
            line.stale_heartbeat_ns, line.gate_wake_ns = 1000 + index, 2000 + index
            line.failed_open_ns = 3000 + index
        account.slots_used = 7
        account.proc[5].state = region_mod.SLOT_RECLAIMING  # not live: not read
        for gpu in (0, 1):
            record = region.failed_open(gpu)
            assert record is not None
            assert checks.failed_open(tmp_path / "job", gpu) == (
                record.heartbeat_ns, record.wake_ns, record.at_ns)
        assert checks.failed_open(tmp_path / "job", 1) == (1003, 2003, 3003)
