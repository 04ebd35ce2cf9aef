"""Measured on simgpu: the real daemon, the FUSE tree, regions and workloads under libcgpu.

Bounds are generous (this host is shared and small); `make bench` prints
the precise figures.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.simbox import SimNode, missing

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))
KERNEL_US = 1000


@pytest.fixture
def node(tmp_path: Path, control_tree: Path) -> Iterator[SimNode]:
    sim = SimNode(tmp_path, control_tree)
    yield sim
    sim.close()


def set_node(root: Path, relpath: str, value: int) -> None:
    (root / relpath).write_text(f"{value}\n")


def test_weighted_one_to_two(node: SimNode) -> None:
    set_node(node.root, "0/policy", 2)
    node.add("a", weight=1)
    node.add("b", weight=2)
    node.start("a", us=KERNEL_US)
    node.start("b", us=KERNEL_US)
    node.start_daemon()
    time.sleep(1)
    got = node.measure(6)
    assert got["b"] / got["a"] == pytest.approx(2.0, rel=0.05), got


def test_fair_share_caps_at_one_over_max_inst(node: SimNode) -> None:
    set_node(node.root, "0/policy", 0)
    set_node(node.root, "0/max_inst", 4)
    node.add("a")
    node.add("b")
    node.start("a", us=KERNEL_US)
    node.start("b", us=KERNEL_US)
    node.start_daemon()
    time.sleep(1)
    got = node.measure(4)
    for name in ("a", "b"):
        assert 0.20 <= got[name] <= 0.28, got


def test_preemptive_lone_active_container_gets_the_gpu(node: SimNode) -> None:
    node.add("a")
    node.add("idle")
    node.start("a", us=KERNEL_US)
    node.start_daemon()
    time.sleep(1)
    assert node.measure(3)["a"] >= 0.95


def test_soft_lends_idle_time_then_shares_by_weight(node: SimNode) -> None:
    set_node(node.root, "0/policy", 4)
    node.add("a", weight=1)
    node.add("b", weight=2)
    node.start("a", us=KERNEL_US)
    node.start_daemon()
    time.sleep(1)
    assert node.measure(3)["a"] >= 0.9
    node.start("b", us=KERNEL_US)
    time.sleep(1)
    got = node.measure(5)
    assert got["b"] / got["a"] == pytest.approx(2.0, rel=0.08), got


def test_fixed_holds_weight_over_max_inst(node: SimNode) -> None:
    set_node(node.root, "0/policy", 3)
    set_node(node.root, "0/max_inst", 8)
    node.add("a", weight=2)
    node.add("b", weight=1)
    node.start("a", us=KERNEL_US)
    node.start_daemon()
    time.sleep(1)
    assert node.measure(4)["a"] == pytest.approx(0.25, abs=0.03)


def test_highprio_takes_prio_ratio(node: SimNode) -> None:
    set_node(node.root, "0/prio_ratio", 70)
    node.add("hp", highprio=1)
    node.add("b")
    node.start("hp", us=KERNEL_US)
    node.start("b", procs=2, us=KERNEL_US)
    node.start_daemon()
    time.sleep(1)
    got = node.measure(5)
    assert got["hp"] == pytest.approx(0.70, abs=0.05), got


def test_util_limit_caps(node: SimNode) -> None:
    node.add("a", util_limit=30)
    node.start("a", us=KERNEL_US)
    node.start_daemon()
    time.sleep(1)
    assert node.measure(4)["a"] <= 0.32


def test_policy_echo_takes_effect_at_once(node: SimNode) -> None:
    set_node(node.root, "0/max_inst", 4)
    node.add("a")
    node.start("a", us=KERNEL_US)
    node.start_daemon(0.05)
    time.sleep(1)
    assert node.measure(2)["a"] >= 0.95
    set_node(node.root, "0/policy", 0)
    time.sleep(0.1)  # two periods
    assert node.measure(3)["a"] <= 0.27


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["KILL", "TERM"])
def test_a_dead_daemon_never_leaves_workloads_blocked(node: SimNode, sig: int) -> None:
    set_node(node.root, "0/policy", 0)
    set_node(node.root, "0/max_inst", 10)
    node.add("a")
    node.start("a", us=KERNEL_US)
    node.start_daemon()
    time.sleep(1)
    assert node.measure(2)["a"] <= 0.12
    node.kill_daemon(sig)
    if sig == signal.SIGKILL:
        time.sleep(2.5)  # the heartbeat goes stale: gates fail open
    assert node.measure(2)["a"] >= 0.9


def test_a_restarted_daemon_reattaches_and_holds_the_share_again(node: SimNode) -> None:
    set_node(node.root, "0/policy", 0)
    set_node(node.root, "0/max_inst", 5)
    node.add("a")
    node.start("a", us=KERNEL_US)
    node.start_daemon()
    time.sleep(1)
    assert node.measure(2)["a"] == pytest.approx(0.20, abs=0.03)
    node.kill_daemon(signal.SIGKILL)
    node.start_daemon()  # a new process: the tree, the region and the workload are as they were
    time.sleep(1)
    assert node.measure(3)["a"] == pytest.approx(0.20, abs=0.03)
    assert "restored scheduler state" in node.daemon_log()


def test_two_gpus_are_scheduled_independently(tmp_path: Path, control_tree: Path) -> None:
    node = SimNode(tmp_path, control_tree, gpus=2)
    try:
        set_node(control_tree, "0/policy", 2)
        set_node(control_tree, "1/policy", 0)
        set_node(control_tree, "1/max_inst", 4)
        node.add("a", gpu=0, weight=1)
        node.add("b", gpu=0, weight=2)
        node.add("c", gpu=1)
        for name, gpu in (("a", 0), ("b", 0), ("c", 1)):
            node.start(name, us=KERNEL_US)
            assert node.regions[name].gpu_spec(0).host_index == gpu
        node.start_daemon()
        time.sleep(1)
        first = node.measure(4, gpu=0)
        assert first["b"] / first["a"] == pytest.approx(2.0, rel=0.08), first
        assert node.measure(3, gpu=1)["c"] == pytest.approx(0.25, abs=0.03)
    finally:
        node.close()
