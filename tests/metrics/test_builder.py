"""SnapshotBuilder: the daemon's readings plus the tree become a snapshot; rates between builds."""

from __future__ import annotations

import pytest

from cgpu_km.gpus import GpuInfo
from cgpu_km.snapshot import UNKNOWN_GPU, ProcessFigures, Snapshot, SnapshotBuilder
from cgpu_km.treefs import ContainerView, GpuView, TreeView

T4 = 15109 << 20


def _tree() -> TreeView:
    gpu0 = GpuView(index=0, policy=2, max_inst=16, prio_ratio=80, free_weight=10, major=0)
    gpu0.containers["a"] = ContainerView(name="a", id=1, memsize=6 << 30, weight=2, highprio=0,
                                         util_limit=0, free=0, procs={7: 1 << 30, 5: 2 << 20})
    gpu0.containers["b"] = ContainerView(name="b", id=2, memsize=0, weight=4, highprio=1,
                                         util_limit=50, free=0)
    gpu1 = GpuView(index=1, policy=1, max_inst=8, prio_ratio=90, free_weight=8, major=0)
    return TreeView(version="0.1.0", default_memsize=0, upgrade=0, gpus=[gpu0, gpu1])


@pytest.fixture
def builder() -> SnapshotBuilder:
    return SnapshotBuilder(version="0.1.0", pid=123, period=0.05, started=1000.0,
                           identities={0: GpuInfo(0, "GPU-x", "Tesla T4", T4)})


def _build(builder: SnapshotBuilder, now: float, a: float, b: float) -> Snapshot:
    return builder.build(now=now, tree=_tree(), usage={(0, "a"): a, (0, "b"): b},
                         shares={(0, "a"): 1 / 3, (0, "b"): 2 / 3},
                         gate_wait={(0, "a"): 0.5}, oom_events={(0, "b"): 2},
                         gpu_memory_used={0: 3 << 30})


def test_first_build_has_figures_but_no_rates(builder: SnapshotBuilder) -> None:
    snap = _build(builder, 2000.0, 10.0, 20.0)
    assert (snap.version, snap.pid, snap.period_seconds, snap.started, snap.timestamp) == (
        "0.1.0", 123, 0.05, 1000.0, 2000.0)
    a = snap.container(0, "a")
    b = snap.container(0, "b")
    assert a is not None
    assert b is not None
    assert a.memory_limit_bytes == 6 << 30
    assert b.memory_limit_bytes == T4  # memsize 0: the whole device
    assert a.memory_used_bytes == (1 << 30) + (2 << 20)
    assert a.processes == (ProcessFigures(5, 2 << 20), ProcessFigures(7, 1 << 30))
    assert (a.gpu_time_seconds, a.gate_wait_seconds, a.oom_events) == (10.0, 0.5, 0)
    assert (b.oom_events, b.highprio, b.util_limit, b.weight) == (2, True, 50, 4)
    assert a.target_share == pytest.approx(1 / 3)
    assert a.utilization == 0.0
    gpu0 = snap.gpu(0)
    assert gpu0 is not None
    assert (gpu0.uuid, gpu0.name, gpu0.memory_total_bytes, gpu0.memory_used_bytes) == (
        "GPU-x", "Tesla T4", T4, 3 << 30)
    assert gpu0.utilization is None
    assert (gpu0.policy, gpu0.max_inst, gpu0.prio_ratio, gpu0.free_weight) == (2, 16, 80, 10)


def test_rates_between_builds(builder: SnapshotBuilder) -> None:
    _build(builder, 2000.0, 10.0, 20.0)
    snap = _build(builder, 2002.0, 10.5, 21.0)  # 0.5 s and 1 s of GPU time in 2 s
    a = snap.container(0, "a")
    b = snap.container(0, "b")
    gpu0 = snap.gpu(0)
    assert a is not None
    assert b is not None
    assert gpu0 is not None
    assert a.utilization == pytest.approx(0.25)
    assert b.utilization == pytest.approx(0.5)
    assert gpu0.utilization == pytest.approx(0.75)
    # A counter that went down (a region recreated) is a new baseline, not a negative rate.
    later = _build(builder, 2003.0, 0.2, 21.0)
    a = later.container(0, "a")
    assert a is not None
    assert a.utilization == 0.0


def test_gpu_without_identity_or_containers(builder: SnapshotBuilder) -> None:
    snap = _build(builder, 2000.0, 0.0, 0.0)
    gpu1 = snap.gpu(1)
    assert gpu1 is not None
    assert (gpu1.uuid, gpu1.name, gpu1.memory_total_bytes) == (
        UNKNOWN_GPU.uuid, UNKNOWN_GPU.name, 0)
    assert gpu1.memory_used_bytes is None
    assert (gpu1.policy, gpu1.max_inst, gpu1.prio_ratio) == (1, 8, 90)
    assert [c.name for c in snap.containers] == ["a", "b"]
    assert Snapshot.from_json(snap.to_json()) == snap
