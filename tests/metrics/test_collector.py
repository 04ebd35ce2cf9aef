"""The collector over a snapshot: values, names and labels, swapping, the listen option."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from cgpu_km.daemon.metrics import (
    CONTAINER_LABELS,
    GPU_LABELS,
    METRICS,
    ListenAddress,
    SnapshotHolder,
    make_registry,
    parse_listen,
)
from cgpu_km.daemon.snapshot import Snapshot

ABC = {"gpu": "0", "uuid": "GPU-5e1d0f6a-0000-4000-8000-000000000000",
       "container": "abc123def456"}
TRAIN = {"gpu": "1", "uuid": "GPU-5e1d0f6a-0000-4000-8000-000000000001", "container": "train"}
GPU0 = {"gpu": ABC["gpu"], "uuid": ABC["uuid"]}
GPU1 = {"gpu": TRAIN["gpu"], "uuid": TRAIN["uuid"]}


@pytest.fixture
def registry(known_snapshot: Snapshot) -> CollectorRegistry:
    return make_registry(SnapshotHolder(known_snapshot))


@pytest.mark.parametrize(
    ("name", "labels", "value"),
    [
        ("cgpu_container_memory_limit_bytes", ABC, 6337173913),
        ("cgpu_container_memory_used_bytes", ABC, 1536 << 20),
        ("cgpu_container_gpu_time_seconds_total", ABC, 125.5),
        ("cgpu_container_target_share_ratio", ABC, 0.2),
        ("cgpu_container_utilization_ratio", ABC, 0.25),
        ("cgpu_container_gate_wait_seconds_total", ABC, 12.25),
        ("cgpu_container_oom_events_total", ABC, 3),
        ("cgpu_container_weight", ABC, 2),
        ("cgpu_container_highprio", ABC, 0),
        ("cgpu_container_processes", ABC, 2),
        ("cgpu_container_unmanaged_processes", ABC, 1),
        ("cgpu_container_bypass_stops_total", ABC, 2),
        ("cgpu_container_bypass_stops_total", TRAIN, 0),
        ("cgpu_container_util_limit_ratio", TRAIN, 0.5),
        ("cgpu_container_util_limit_ratio", ABC, 0),
        ("cgpu_container_memory_limit_bytes", TRAIN, 15109 << 20),
        ("cgpu_gpu_memory_total_bytes", GPU0, 15109 << 20),
        ("cgpu_gpu_memory_used_bytes", GPU0, 3 << 30),
        ("cgpu_gpu_utilization_ratio", GPU0, 0.75),
        ("cgpu_gpu_policy", GPU0, 1),
        ("cgpu_gpu_max_inst", GPU0, 16),
        ("cgpu_gpu_free_weight", GPU0, 10),
        ("cgpu_gpu_free_weight", GPU1, 15),
        ("cgpu_gpu_prio_ratio", GPU1, 0.8),
        ("cgpu_gpu_info", {**GPU0, "name": "Tesla T4"}, 1),
        ("cgpu_build_info", {"version": "0.1.0"}, 1),
        ("cgpu_scheduler_period_seconds", {}, 0.05),
        ("cgpu_snapshot_timestamp_seconds", {}, 1796000000.0),
        ("cgpu_daemon_start_time_seconds", {}, 1795999000.0),
    ],
)
def test_sample_values(registry: CollectorRegistry, name: str, labels: dict[str, str],
                       value: float) -> None:
    assert registry.get_sample_value(name, labels) == pytest.approx(value)


def test_unknown_gpu_figures_are_left_out(registry: CollectorRegistry) -> None:
    # GPU 1's NVML gave no utilization or used memory: no sample, not a false 0.
    assert registry.get_sample_value("cgpu_gpu_utilization_ratio", GPU1) is None
    assert registry.get_sample_value("cgpu_gpu_memory_used_bytes", GPU1) is None
    assert registry.get_sample_value("cgpu_gpu_memory_total_bytes", GPU1) == 15109 << 20


def test_nothing_before_the_first_snapshot() -> None:
    holder = SnapshotHolder()
    registry = make_registry(holder)
    assert list(registry.collect()) == []


def test_swap_changes_what_is_scraped(known_snapshot: Snapshot) -> None:
    holder = SnapshotHolder(known_snapshot)
    registry = make_registry(holder)
    container = dataclasses.replace(known_snapshot.containers[0], gpu_time_seconds=200.0)
    holder.swap(dataclasses.replace(known_snapshot, containers=(container,)))
    assert registry.get_sample_value("cgpu_container_gpu_time_seconds_total", ABC) == 200.0
    assert registry.get_sample_value("cgpu_container_weight", TRAIN) is None  # gone


def test_every_family_is_exported_with_its_declared_type(registry: CollectorRegistry) -> None:
    families = {f.name: f for f in registry.collect()}
    for spec in METRICS:
        base = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
        base = base.removesuffix("_info") if spec.kind == "info" else base
        assert families[base].type == spec.kind, spec.name
        assert families[base].samples, f"{spec.name} has no sample in the known snapshot"


UNIT_SUFFIXES = ("_bytes", "_seconds", "_seconds_total", "_ratio", "_total", "_info")
UNITLESS = {"cgpu_gpu_policy", "cgpu_gpu_max_inst", "cgpu_gpu_free_weight",
            "cgpu_container_weight", "cgpu_container_highprio", "cgpu_container_processes",
            "cgpu_container_unmanaged_processes"}


@pytest.mark.parametrize("spec", METRICS, ids=lambda s: s.name)
def test_names_and_labels_follow_the_conventions(spec: object) -> None:
    from cgpu_km.daemon.metrics import MetricSpec

    assert isinstance(spec, MetricSpec)
    assert re.fullmatch(r"cgpu_[a-z_]+", spec.name)
    assert spec.name.count("cgpu_") == 1
    assert spec.name.endswith("_total") == (spec.kind == "counter")
    assert spec.name.endswith("_info") == (spec.kind == "info")
    assert spec.name.endswith(UNIT_SUFFIXES) or spec.name in UNITLESS
    assert not re.search(r"percent|milli|micro|kib|mib|gib", spec.name)
    assert spec.labels in ((), GPU_LABELS, CONTAINER_LABELS)
    assert "pid" not in spec.labels + spec.info_labels
    assert spec.help.endswith(".")


def test_ratios_stay_between_zero_and_one(registry: CollectorRegistry) -> None:
    for family in registry.collect():
        if family.name.endswith("_ratio"):
            for sample in family.samples:
                assert 0 <= sample.value <= 1, sample


def test_no_label_carries_a_pid(registry: CollectorRegistry, known_snapshot: Snapshot) -> None:
    pids = {str(p.pid) for c in known_snapshot.containers for p in c.processes}
    assert pids
    for family in registry.collect():
        for sample in family.samples:
            assert not pids & set(sample.labels.values()), sample


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9400", ListenAddress("127.0.0.1", 9400)),
        ("0.0.0.0:0", ListenAddress("0.0.0.0", 0)),
        ("[::1]:9400", ListenAddress("::1", 9400)),
        ("localhost:80", ListenAddress("localhost", 80)),
        ("off", None),
        (" OFF ", None),
    ],
)
def test_parse_listen(text: str, expected: ListenAddress | None) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("9400", "expected HOST:PORT"),
        (":9400", "expected HOST:PORT"),
        ("host:", "port must be 0..65535"),
        ("host:65536", "port must be 0..65535"),
        ("host:-1", "port must be 0..65535"),
        ("::1:9400", r"\[HOST\]:PORT"),
        ("[::1:9400", "unbalanced"),
    ],
)
def test_parse_listen_rejects(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_listen(text)


def test_metrics_doc_lists_every_metric() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operator" / "metrics.md").read_text()
    for spec in METRICS:
        assert f"| `{spec.name}` | {spec.kind} |" in doc, spec.name
