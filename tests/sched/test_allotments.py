"""The policy table as shares: rows of docs/design.md checked one by one, then invariants."""

from __future__ import annotations

from fractions import Fraction as F

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cgpu_km.sched import ContainerSpec, GpuConfig, Policy, allotments, waterfill


def shares(
    policy: int, specs: dict[str, ContainerSpec], active: set[str], **kw: int
) -> dict[str, F]:
    config = GpuConfig(policy=Policy(policy), containers=specs, **kw)
    return {n: a.share for n, a in allotments(config, active).items()}


W = ContainerSpec


def test_fair_share_is_one_over_max_inst_for_everyone() -> None:
    got = shares(0, {"a": W(1), "b": W(3)}, {"a", "b"}, max_inst=4)
    assert got == {"a": F(1, 4), "b": F(1, 4)}


def test_preemptive_splits_between_active_ones_and_a_lone_one_gets_all() -> None:
    specs = {"a": W(1), "b": W(3), "c": W(2)}
    assert shares(1, specs, {"a", "b"}) == {"a": F(1, 2), "b": F(1, 2), "c": 0}
    assert shares(1, specs, {"c"}) == {"a": 0, "b": 0, "c": 1}


def test_weighted_counts_idle_containers_weight() -> None:
    got = shares(2, {"a": W(1), "b": W(2), "c": W(5)}, {"a", "b"})
    assert got == {"a": F(1, 8), "b": F(2, 8), "c": F(5, 8)}


def test_fixed_is_weight_over_max_inst() -> None:
    got = shares(3, {"a": W(1), "b": W(2)}, {"a", "b"}, max_inst=10)
    assert got == {"a": F(1, 10), "b": F(2, 10)}


def test_soft_is_weight_over_active_weights() -> None:
    got = shares(4, {"a": W(1), "b": W(2), "c": W(5)}, {"a", "b"})
    assert got == {"a": F(1, 3), "b": F(2, 3), "c": 0}


def test_native_gives_everyone_the_gpu_except_util_limit() -> None:
    got = shares(5, {"a": W(0), "b": W(2, util_limit=30)}, set())
    assert got == {"a": 1, "b": F(3, 10)}


@pytest.mark.parametrize("policy", [0, 1, 2, 3, 4])
def test_weight_zero_gets_no_compute(policy: int) -> None:
    got = shares(policy, {"a": W(0), "b": W(1)}, {"a", "b"})
    assert got["a"] == 0
    assert got["b"] > 0


def test_eight_to_four_is_two_to_one() -> None:
    for policy in (2, 4):
        assert shares(policy, {"a": W(8), "b": W(4)}, {"a", "b"}) == shares(
            policy, {"a": W(2), "b": W(1)}, {"a", "b"}
        )


@pytest.mark.parametrize("policy", [1, 4])
def test_highprio_takes_prio_ratio_and_others_share_the_rest(policy: int) -> None:
    specs = {"hp": W(1, highprio=True), "a": W(1), "b": W(3)}
    got = shares(policy, specs, {"hp", "a", "b"}, prio_ratio=80)
    assert got["hp"] == F(4, 5)
    assert got["a"] + got["b"] == F(1, 5)
    if policy == 4:
        assert got["b"] == 3 * got["a"]
    else:
        assert got["b"] == got["a"]


def test_idle_highprio_takes_nothing() -> None:
    specs = {"hp": W(1, highprio=True), "a": W(1)}
    assert shares(4, specs, {"a"}) == {"hp": 0, "a": 1}


def test_highprio_under_weighted_scales_the_others_and_keeps_idle_slices() -> None:
    specs = {"hp": W(1, highprio=True), "a": W(1), "b": W(2)}
    got = shares(2, specs, {"hp", "a"}, prio_ratio=70)
    assert got == {"hp": F(7, 10), "a": F(1, 10), "b": F(2, 10)}


def test_highprio_never_below_its_plain_share() -> None:
    specs = {"hp": W(10, highprio=True), "a": W(1)}
    got = shares(3, specs, {"hp", "a"}, max_inst=11, prio_ratio=20)
    assert got["hp"] == F(10, 11)


def test_util_limit_caps_and_soft_lends_the_rest() -> None:
    got = shares(4, {"a": W(1, util_limit=10), "b": W(1)}, {"a", "b"})
    assert got == {"a": F(1, 10), "b": F(9, 10)}
    got = shares(2, {"a": W(1, util_limit=10), "b": W(1)}, {"a", "b"})
    assert got == {"a": F(1, 10), "b": F(1, 2)}


def test_waterfill_is_exact_and_respects_caps() -> None:
    got = waterfill(F(1), {"a": F(1), "b": F(1), "c": F(2)}, {"a": F(1, 10), "b": F(1), "c": F(1)})
    assert got == {"a": F(1, 10), "b": F(3, 10), "c": F(6, 10)}


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="max_inst"):
        GpuConfig(max_inst=0)
    with pytest.raises(ValueError, match="is not a valid Policy"):
        GpuConfig(policy=7)  # type: ignore[arg-type]


specs_strategy = st.dictionaries(
    st.sampled_from(["a", "b", "c", "d", "e", "f"]),
    st.builds(
        ContainerSpec,
        weight=st.integers(0, 4),
        highprio=st.booleans(),
        util_limit=st.sampled_from([0, 0, 0, 5, 30, 95]),
    ),
    min_size=1,
)


@given(
    policy=st.sampled_from(list(Policy)),
    specs=specs_strategy,
    active_mask=st.lists(st.booleans(), min_size=6, max_size=6),
    prio_ratio=st.integers(20, 99),
    scale=st.integers(1, 4),
)
def test_invariants(
    policy: Policy, specs: dict[str, ContainerSpec], active_mask: list[bool], prio_ratio: int,
    scale: int,
) -> None:
    active = {n for n, on in zip(sorted(specs), active_mask, strict=False) if on}
    max_inst = 25
    config = GpuConfig(policy=policy, max_inst=max_inst, prio_ratio=prio_ratio, containers=specs)
    got = allotments(config, active)
    for name, allot in got.items():
        assert 0 <= allot.share <= allot.cap <= 1
        if specs[name].util_limit:
            assert allot.share <= F(specs[name].util_limit, 100)
    if policy is not Policy.NATIVE:
        assert sum(a.share for n, a in got.items() if n in active or policy in (1, 4)) <= 1
        assert all(got[n].share == 0 for n in specs if specs[n].weight == 0)
    runnable = {n for n in active if specs[n].weight > 0}
    if policy in (Policy.PREEMPTIVE, Policy.SOFT) and runnable:
        uncapped = any(specs[n].util_limit == 0 for n in runnable)
        total = sum(got[n].share for n in runnable)
        assert total == 1 if uncapped else total <= 1
        assert all(got[n].share == 0 for n in specs if n not in runnable)
    # Scaling every weight (and max_inst with it) changes nothing.
    scaled = GpuConfig(
        policy=policy, max_inst=max_inst * scale, prio_ratio=prio_ratio,
        containers={
            n: ContainerSpec(s.weight * scale, s.highprio, s.util_limit) for n, s in specs.items()
        },
    )
    if policy is not Policy.FAIR_SHARE:
        assert allotments(scaled, active) == got
