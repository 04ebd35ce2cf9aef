"""The soak's plan: a pure, seeded function of what happens when."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from tests.soak.plan import (
    FAULTS,
    MIB,
    PAIR_DELAY,
    T4,
    Event,
    Fault,
    Pair,
    Start,
    Write,
    fault_times,
    make_plan,
    ratio_at,
)


def test_the_same_seed_gives_the_same_plan_and_another_seed_another() -> None:
    assert make_plan(7, 600) == make_plan(7, 600)
    assert make_plan(7, 600) != make_plan(8, 600)


def test_a_ten_minute_plan_churns_hundreds_and_has_every_fault_kind() -> None:
    events = make_plan(1, 600)
    starts = [e for e in events if isinstance(e, Start)]
    assert 200 <= len(starts) <= 400
    assert {s.container.engine for s in starts} == {"docker", "runc"}
    assert {f.kind for f in events if isinstance(f, Fault)} == set(FAULTS)
    assert all(a.at <= b.at for a, b in itertools.pairwise(events))


def test_a_one_minute_plan_has_each_fault_once_and_cgpu_fuse_s_restart_last() -> None:
    faults = [e for e in make_plan(3, 60) if isinstance(e, Fault)]
    assert sorted(f.kind for f in faults) == sorted(FAULTS)
    assert faults[-1].kind == "fuse-kill"
    assert fault_times(60) == [8.571, 17.143, 25.714, 34.286, 42.857, 51.429]
    assert len(fault_times(600)) == 19  # every 30 s


@given(st.integers(0, 10**6), st.sampled_from([60.0, 300.0, 600.0]))
def test_every_container_is_valid_and_its_limit_follows_the_documents(seed: int,
                                                                     seconds: float) -> None:
    for event in make_plan(seed, seconds):
        if not isinstance(event, Start):
            continue
        spec = event.container
        env = dict(spec.env)
        assert 0 <= spec.gpu < 8
        assert 1 <= int(env["ALIYUN_COM_GPU_SCHD_WEIGHT"]) <= 3
        if "AMP_VGPU_ENABLE" in env:
            assert spec.limit == int(env["GPU_MEM_PER_DEVICE"]) - 10 * MIB
        else:
            assert spec.limit == T4 * int(env["ALIYUN_COM_GPU_MEM_CONTAINER"]) // 15
        assert 0 < spec.limit < T4
        assert 4 <= spec.lifetime <= 12


def test_a_new_pair_follows_every_cgpu_fuse_restart_and_pairs_tile_the_run() -> None:
    events = make_plan(5, 600)
    pairs = [e for e in events if isinstance(e, Pair)]
    assert pairs[0].at == 0
    assert all(a.until == b.at for a, b in itertools.pairwise(pairs))
    for fault in (e for e in events if isinstance(e, Fault) and e.kind == "fuse-kill"):
        assert any(p.at == fault.at + PAIR_DELAY for p in pairs)


def test_the_ratio_follows_the_policy_and_the_pair_s_weights() -> None:
    events: list[Event] = [Pair(0, 10, ((1, 2),)), Write(2, 0, "policy", 1),
                           Write(4, 0, "policy", 4), Write(6, 0, "weight1", 4),
                           Pair(10, 20, ((3, 1),))]
    assert ratio_at(events, 0, 1) == 2  # the soak's initial policy 2
    assert ratio_at(events, 0, 3) == 1
    assert ratio_at(events, 0, 5) == 2
    assert ratio_at(events, 0, 7) == 0.5
    assert ratio_at(events, 0, 11) == 1 / 3  # a new pair's own weights
    assert ratio_at(events, 0, 25) is None
