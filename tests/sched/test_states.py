"""The slice scheduler's states and transitions, one step at a time.

Pure: each test steps a `SliceScheduler` at chosen times with chosen
observations and looks at `state` (and `late_record`) after each, as the
module docstring's table names them. No model, no clock.
"""

from __future__ import annotations

import pytest

from cgpu_km.sched import ContainerSpec, GpuConfig, Observation, Policy, SliceScheduler
from cgpu_km.sched.slices import LONE_SLICE, Draining, Holding, Idle, Late, Native, State

W = ContainerSpec
WAITING = Observation(waiting=True)
SILENT = Observation(waiting=True, answered=False)


def scheduler(*names: str, policy: Policy = Policy.PREEMPTIVE, **kw: float) -> SliceScheduler:
    config = GpuConfig(policy=policy, containers={n: W(1) for n in names})
    return SliceScheduler(config, quantum=0.02, drain_timeout=0.1, **kw)


def state(s: SliceScheduler) -> State:
    return s.state  # a call: each look is a new value to the type checker


def late(s: SliceScheduler, name: str) -> tuple[object, ...]:
    """`name`'s Late record as a tuple (to compare with pytest.approx)."""
    record = s.late_record(name)
    assert record is not None, f"{name} is not late"
    return record.since, record.deadline, record.refund


def busy(launches: int) -> Observation:
    return Observation(waiting=True, launches=launches)


def draining_b() -> SliceScheduler:
    """b granted at 0 beside a (both waiting: passed over, a is not waking), its
    slice closed at 0.02."""
    s = scheduler("a", "b")
    assert s.step(0.0, {"a": WAITING, "b": WAITING}).holder == "b"  # the same credit: by name
    s.step(0.02, {"a": WAITING, "b": busy(1)})
    assert state(s) == Draining("b", closed_at=0.02, paid_to=0.02)
    return s


def test_idle_until_someone_waits_then_holding() -> None:
    s = scheduler("a")
    assert state(s) == Idle()
    assert s.step(0.0, {}).open == frozenset()
    assert state(s) == Idle()
    s.step(0.01, {"a": WAITING})
    assert state(s) == Holding("a", slice_start=0.01, slice_end=0.03, paid_to=0.01)


def test_a_lone_holder_is_renewed_without_a_drain() -> None:
    s = scheduler("a")
    s.step(0.0, {"a": WAITING})
    decision = s.step(0.02, {"a": busy(1)})
    assert decision.open == {"a"}
    assert state(s) == Holding("a", slice_start=0.02, slice_end=0.02 + LONE_SLICE, paid_to=0.02)
    assert s.used()["a"] == pytest.approx(0.02), "the slice so far is paid at its end"


def test_a_slice_with_company_ends_in_a_drain() -> None:
    s = draining_b()
    decision = s.step(0.03, {"a": WAITING, "b": SILENT})
    assert decision.open == frozenset(), "nobody runs while the holder drains"
    assert decision.wake_at == pytest.approx(0.12), "at the drain limit"
    assert s.holder == "b"
    assert s.draining


def test_a_slice_with_company_names_its_end_and_a_lone_one_does_not() -> None:
    """The decision names the end of a slice another container waits for
    (`close_at`), and when to step at the latest if the holder closes itself
    then: at the drain limit after that end (`close_wake`)."""
    s = scheduler("a", "b")
    decision = s.step(0.0, {"a": WAITING, "b": WAITING})
    assert decision.holder == "b"
    assert decision.close_at == pytest.approx(0.02)
    assert decision.close_wake == pytest.approx(0.12)
    decision = s.step(0.01, {"a": WAITING, "b": busy(1)})
    assert decision.close_at == pytest.approx(0.02), "the same end as the slice goes on"
    lone = scheduler("a")
    decision = lone.step(0.0, {"a": WAITING})
    assert decision.close_at is None, "nobody waits: its slice may be renewed"


def test_a_holder_seen_after_its_named_end_drains_from_that_end() -> None:
    """A holder that closed itself at its slice's end is stepped on its answer,
    later: it is charged until then, but its drain began at the end, so one
    that never answers is cut at the drain limit after the end (not after the
    late step)."""
    def one_to_nine() -> SliceScheduler:  # a is never owed enough to take the GPU
        config = GpuConfig(policy=Policy.PREEMPTIVE, containers={"a": W(1), "b": W(9)})
        s = SliceScheduler(config, quantum=0.02, drain_timeout=0.1)
        assert s.step(0.0, {"a": WAITING, "b": WAITING}).close_at == pytest.approx(0.02)
        return s

    s = one_to_nine()
    s.step(0.03, {"a": WAITING, "b": SILENT})
    assert state(s) == Draining("b", closed_at=0.02, paid_to=0.03)
    assert s.used()["b"] == pytest.approx(0.03)
    s.step(0.03, {"a": WAITING, "b": Observation(waiting=True, launches=1)})
    assert s.holder == "a", "answered: granted in the step after"
    hostile = one_to_nine()
    wake = hostile.step(0.0, {"a": WAITING, "b": busy(1)}).close_wake
    assert wake == pytest.approx(0.12)
    hostile.step(wake, {"a": WAITING, "b": SILENT})
    hostile.step(wake, {"a": WAITING, "b": SILENT})
    assert hostile.holder == "a", "0.1 s after its end"
    assert hostile.late == {"b"}


def test_a_holder_that_closed_itself_at_its_end_is_not_waited_for() -> None:
    """Its processes stopped at the end they were told and answered the close to
    come: the step that sees it ends its turn, charged until then, and grants
    (no drain to await)."""
    s = scheduler("a", "b")
    s.step(0.0, {"a": WAITING, "b": WAITING})
    decision = s.step(0.021, {"a": WAITING, "b": Observation(waiting=True, closed_itself=True)})
    assert decision.holder == "a"
    assert state(s) == Holding("a", slice_start=0.021, slice_end=0.041, paid_to=0.021)
    assert s.used()["b"] == pytest.approx(0.021)
    assert s.moves_by_row()["ended"] == 1
    early = scheduler("a", "b")
    early.step(0.0, {"a": WAITING, "b": WAITING})
    decision = early.step(0.01, {"a": WAITING, "b": Observation(waiting=True,
                                                                 closed_itself=True)})
    assert early.holder == "b", "before its end: its slice goes on"
    assert isinstance(state(early), Holding)
    # It rings no more: the step is at its end, not at the drain limit after.
    assert decision.close_wake == pytest.approx(0.02)
    early.step(0.02, {"a": WAITING, "b": Observation(waiting=True, closed_itself=True)})
    assert early.holder == "a"
    assert early.moves_by_row()["ended"] == 1
    # A holder granted again in the step that ended its turn (1:2: the larger
    # share takes two turns in a row) is asked anew: its answer was the last
    # turn's.
    again = SliceScheduler(GpuConfig(policy=Policy.WEIGHTED,
                                     containers={"a": W(1), "b": W(2)}),
                           quantum=0.02, drain_timeout=0.1)
    decision = again.step(0.0, {"a": WAITING, "b": WAITING})
    regrants = 0
    for turn in range(1, 30):
        holder, end = decision.holder, decision.close_at
        assert holder is not None
        assert end is not None
        now = end + 0.001
        decision = again.step(now, {n: Observation(waiting=True, closed_itself=n == holder)
                                    for n in "ab"})
        assert again.moves_by_row()["ended"] == turn
        assert decision.close_at == pytest.approx(now + 0.02)
        assert decision.close_wake == pytest.approx(now + 0.02 + 0.1), "its answer is awaited"
        regrants += decision.holder == holder
    assert regrants >= 5


def test_an_answer_ends_the_drain_and_grants_in_the_same_step() -> None:
    s = draining_b()
    decision = s.step(0.025, {"a": WAITING, "b": Observation(waiting=True, launches=1)})
    assert decision.open == {"a"}
    assert state(s) == Holding("a", slice_start=0.025, slice_end=0.045, paid_to=0.025)
    assert s.late == frozenset()
    assert s.used()["b"] == pytest.approx(0.025), "charged until its answer was seen"


def test_a_drain_past_its_limit_is_cut_and_late() -> None:
    s = draining_b()
    limit = s.step(0.03, {"a": WAITING, "b": SILENT}).wake_at
    s.step(limit, {"a": WAITING, "b": SILENT})
    assert state(s) == Holding("a", slice_start=limit, slice_end=limit + 0.02, paid_to=limit,
                              sharing="b"), "b's queued work runs beside a: the span is shared"
    assert s.late_record("b") == Late(since=limit)
    s.step(0.13, {"a": busy(1), "b": Observation(waiting=True, launches=1)})
    assert s.late_record("b") is None
    assert state(s) == Holding("a", slice_start=limit, slice_end=limit + 0.02, paid_to=0.13)
    # charged until its answer was seen, less its half of the span a shared with it
    assert s.used() == {"a": pytest.approx(0.005), "b": pytest.approx(0.125)}


def test_a_cut_drain_shares_the_span_only_until_the_next_turn_ends() -> None:
    s = scheduler("a", "b", "c")
    s.step(0.0, {"a": WAITING, "b": WAITING, "c": WAITING})  # c: passed over, not waking
    holder = s.holder
    assert holder is not None
    others = {"a", "b", "c"} - {holder}
    s.step(0.02, {holder: busy(1), **{n: WAITING for n in others}})
    limit = s.step(0.03, {holder: SILENT, **{n: WAITING for n in others}}).wake_at
    s.step(limit, {holder: SILENT, **{n: WAITING for n in others}})
    nxt = s.holder
    assert nxt in others
    assert getattr(state(s), "sharing", None) == holder
    seen = {holder: SILENT, nxt: busy(1), **{n: WAITING for n in others - {nxt}}}
    s.step(limit + 0.02, seen)  # its slice ends with company
    assert state(s) == Draining(nxt, closed_at=limit + 0.02, paid_to=limit, sharing=holder)
    s.step(limit + 0.025, seen)  # it answers: the third is granted
    assert s.holder not in (holder, nxt)
    assert getattr(state(s), "sharing", "?") is None, "that turn is not the cut one's to share"
    assert late(s, holder) == (limit, None, pytest.approx(0.0125))
    s.step(0.2, {holder: Observation(waiting=True, launches=1), **{n: WAITING for n in others}})
    assert s.used()[holder] == pytest.approx(0.2 - 0.0125), "in full from that answer on"
    assert s.used()[nxt] == pytest.approx(0.0125)


def handed_over() -> SliceScheduler:
    """a holds from 0; b, rested, wakes at 0.005 and takes the GPU at once."""
    s = scheduler("a", "b")
    s.step(0.0, {"a": WAITING})
    s.step(0.005, {"a": busy(3), "b": WAITING})
    return s


def test_a_waking_container_takes_the_gpu_and_shares_it_with_the_drain() -> None:
    s = handed_over()
    assert state(s) == Holding("b", slice_start=0.005, slice_end=0.025, paid_to=0.005,
                              sharing="a")
    # a's drain is cut at its drain limit after the close
    assert late(s, "a") == (0.005, pytest.approx(0.105), 0.0)
    assert s.used() == {"a": pytest.approx(0.005), "b": 0.0}


def test_the_drainers_answer_ends_the_shared_span() -> None:
    s = handed_over()
    s.step(0.009, {"a": Observation(waiting=True, launches=3), "b": busy(2)})
    assert state(s) == Holding("b", slice_start=0.005, slice_end=0.025, paid_to=0.009)
    assert s.late == frozenset()
    assert s.used() == {"a": pytest.approx(0.007), "b": pytest.approx(0.002)}


def test_a_waker_takes_a_gpu_its_holder_said_it_left_idle_without_a_drain() -> None:
    """a said at 0.004 that it went idle at 0.003, within the grace: b, waking at
    0.005, takes the GPU with nothing to share, and a is paid to 0.003 (the gap
    until b came is nobody's)."""
    s = scheduler("a", "b", policy=Policy.FIXED, idle_grace=0.002)
    s.step(0.0, {"a": WAITING})
    s.step(0.001, {"a": Observation(launches=3)})
    said = Observation(launches=3, active_at=0.003, idle=True)
    s.step(0.005, {"a": said, "b": WAITING})
    assert state(s) == Holding("b", slice_start=0.005, slice_end=0.025, paid_to=0.005)
    assert s.late_record("a") is None, "nothing left to drain"
    assert s.used() == {"a": pytest.approx(0.003), "b": 0.0}
    assert ("Holding", "vacated", "Holding") in s.moves


@pytest.mark.parametrize("policy", [Policy.PREEMPTIVE, Policy.SOFT])
def test_where_time_is_lent_a_waker_takes_an_idle_holders_gpu_by_a_handover(
        policy: Policy) -> None:
    """The same word under the work-conserving policies: the gap costs nobody a
    turn there (time is lent, not owed), and b's wake is a handover as before
    (a late, its drain shared), not `vacated`."""
    s = scheduler("a", "b", policy=policy, idle_grace=0.002)
    s.step(0.0, {"a": WAITING})
    s.step(0.001, {"a": Observation(launches=3)})
    said = Observation(launches=3, active_at=0.003, idle=True)
    s.step(0.005, {"a": said, "b": WAITING})
    assert s.holder == "b"
    assert s.late_record("a") is not None
    assert ("Holding", "handover", "Holding") in s.moves
    assert not any(row == "vacated" for _, row, _ in s.moves)


def test_a_word_of_idleness_saves_its_holder_the_idle_grace_at_most() -> None:
    """a says it went idle at 0.0015, just after its grant, and nothing the steps
    saw says otherwise (it may have run on all the while): when b wakes at
    0.012, a is paid to 0.010, the grace before. A holder idle longer would
    have quit at its ring; one that says so while it runs on gains no more than
    under `quit`."""
    s = scheduler("a", "b", policy=Policy.FIXED, idle_grace=0.002)
    s.step(0.0, {"a": WAITING})
    s.step(0.001, {"a": Observation(launches=3)})
    said = Observation(launches=3, active_at=0.0015, idle=True)
    s.step(0.012, {"a": said, "b": WAITING})
    assert s.holder == "b"
    assert s.used()["a"] == pytest.approx(0.010)
    assert ("Holding", "vacated", "Holding") in s.moves


def test_a_word_of_idleness_that_a_launch_belies_is_a_handover_as_ever() -> None:
    """a says it went idle at 0.001, but it launched after the step at 0.002
    counted its launches: the report is not believed, and b's wake at 0.005 is
    a handover (a late, its drain shared)."""
    s = scheduler("a", "b", policy=Policy.FIXED, idle_grace=0.002)
    s.step(0.0, {"a": WAITING})
    s.step(0.002, {"a": Observation(launches=3)})
    lying = Observation(launches=4, active_at=0.001, idle=True)
    s.step(0.005, {"a": lying, "b": WAITING})
    assert state(s) == Holding("b", slice_start=0.005, slice_end=0.025, paid_to=0.005,
                              sharing="a")
    assert s.late_record("a") is not None
    assert ("Holding", "handover", "Holding") in s.moves


def test_a_handover_drain_past_its_deadline_is_cut_and_stays_late() -> None:
    s = handed_over()
    record = s.late_record("a")
    assert record is not None
    assert record.deadline is not None
    s.step(record.deadline, {"a": SILENT, "b": busy(2)})
    assert late(s, "a") == (0.005, None, 0.0)
    assert s.holder == "b"
    assert getattr(state(s), "sharing", "?") == "a", "a's work still runs beside b's turn"
    s.step(0.2, {"a": SILENT, "b": Observation(launches=2)})  # b idle: its turn ends
    s.step(0.201, {"a": SILENT, "b": Observation(launches=2)})
    assert state(s) == Idle()
    assert late(s, "a") == (0.005, None, pytest.approx(0.098)), "half of 0.005 to 0.201"
    assert s.used()["b"] == pytest.approx(0.098)


def test_the_holders_turn_ending_first_leaves_the_drainer_its_refund() -> None:
    s = handed_over()
    s.step(0.01, {"a": SILENT, "b": busy(2)})
    # b stops launching: idle beside a late container, it gives the GPU up
    s.step(0.013, {"a": SILENT, "b": Observation(launches=2)})
    assert state(s) == Draining("b", closed_at=0.013, paid_to=0.005, sharing="a")
    s.step(0.015, {"a": SILENT, "b": Observation(launches=2)})
    assert state(s) == Idle()
    assert late(s, "a") == (0.005, pytest.approx(0.105), pytest.approx(0.005))
    assert s.used()["b"] == pytest.approx(0.005), "half of the 10 ms it shared"


def test_native_keeps_the_open_gates_as_its_state() -> None:
    config = GpuConfig(policy=Policy.NATIVE, containers={"a": W(1, util_limit=50), "b": W(1)})
    s = SliceScheduler(config)
    s.step(0.0, {})
    assert state(s) == Native(frozenset({"a", "b"}))


def test_a_switch_to_native_ends_the_turn_charged() -> None:
    s = scheduler("a")
    s.step(0.0, {"a": WAITING})
    s.configure(GpuConfig(policy=Policy.NATIVE, containers=s.config.containers))
    s.step(0.01, {"a": busy(1)})
    assert state(s) == Native(frozenset({"a"}))
    assert s.used()["a"] == pytest.approx(0.01)


def test_a_switch_back_from_native_starts_idle() -> None:
    config = GpuConfig(policy=Policy.NATIVE, containers={"a": W(1)})
    s = SliceScheduler(config)
    s.step(0.0, {})
    s.configure(GpuConfig(policy=Policy.WEIGHTED, containers=config.containers))
    assert s.step(0.01, {}).open == frozenset()
    assert state(s) == Idle()


def test_a_drainer_removed_mid_handover_ends_the_shared_span() -> None:
    s = handed_over()
    s.step(0.009, {"a": SILENT, "b": busy(2)})
    s.configure(GpuConfig(policy=Policy.PREEMPTIVE, containers={"b": W(1)}))
    assert state(s) == Holding("b", slice_start=0.005, slice_end=0.025, paid_to=0.009)
    assert s.used()["b"] == pytest.approx(0.002), "half of the 4 ms it shared"


def test_a_removed_holder_leaves_the_gpu_idle() -> None:
    s = scheduler("a", "b")
    s.step(0.0, {"a": WAITING})
    s.configure(GpuConfig(policy=Policy.PREEMPTIVE, containers={"b": W(1)}))
    assert state(s) == Idle()
    assert s.holder is None


# -- armed gates ---------------------------------------------------------------


def test_a_rested_container_is_armed_and_one_at_the_gate_is_not() -> None:
    s = scheduler("a", "b", "c")
    decision = s.step(0.0, {"a": WAITING, "b": busy(1)})
    assert decision.holder == "b"  # the same credit: by name
    assert decision.armed == {"c"}, "a waits at the gate; the holder's gate is open"
    assert s.step(0.001, {"a": WAITING, "b": busy(2)}).armed == {"c"}


def test_a_launch_through_an_armed_gate_takes_the_gpu_at_the_next_step() -> None:
    s = scheduler("a", "b")
    assert s.step(0.0, {"a": busy(1), "b": Observation()}).armed == {"b"}
    # b launched through its armed gate: no process of it waits, yet it wants the GPU
    taken = s.step(0.005, {"a": busy(3), "b": Observation(launches=2)})
    assert taken.open == {"b"}
    assert state(s) == Holding("b", slice_start=0.005, slice_end=0.025, paid_to=0.005,
                               sharing="a")
    assert s.late == {"a"}
    assert taken.armed == frozenset(), "a is late: it drains before any new grant"


def test_a_container_is_armed_once_it_has_rested_half_a_quantum() -> None:
    s = scheduler("a", "b")
    assert s.step(0.0, {"a": busy(1), "b": busy(1)}).holder == "b"  # the same credit: by name
    later = s.step(0.001, {"a": Observation(launches=1), "b": busy(2)})
    assert "a" not in later.armed, "a waited a moment ago: not rested"
    assert later.wake_at <= 0.0101, "a step when a will have rested 10 ms"
    assert "a" in s.step(0.0101, {"a": Observation(launches=1), "b": busy(3)}).armed


def test_the_holder_is_not_armed_while_it_drains() -> None:
    """A draining holder whose gate let launches through would never drain: its
    drain would last to its limit while the others wait (validate.sh's policy 2
    at batch 128, 4 x 3.7 ms kernels and a synchronize, showed 1:0.55 for 1:2)."""
    s = draining_b()  # b last launched at 0.02, a waits at the gate
    quiet = {"a": WAITING, "b": Observation(launches=1, answered=False)}
    closed = s.step(0.035, quiet)  # b's kernels still run: no answer yet
    assert state(s) == Draining("b", closed_at=0.02, paid_to=0.02)
    assert "b" not in closed.armed, "15 ms without a launch, but its gate closed to drain"


def test_no_gate_is_armed_for_a_container_out_of_credit_nor_under_policy_5() -> None:
    s = scheduler("a", "b", policy=Policy.WEIGHTED)  # 1/2 each, idle time stays idle
    s.step(0.0, {"b": WAITING})
    s.step(0.2, {"b": busy(100)})  # b held the GPU alone for 0.2 s: it owes 0.1 s
    s.step(0.2005, {"b": Observation(launches=100, answered=True)})
    assert "b" not in s.step(0.25, {"b": Observation(launches=100)}).armed
    native = scheduler("a", "b", policy=Policy.NATIVE)
    assert native.step(0.0, {}).armed == frozenset()


def test_a_high_priority_holder_arms_only_high_priority_gates() -> None:
    config = GpuConfig(policy=Policy.PREEMPTIVE, containers={
        "hp": W(1, highprio=True), "lo": W(1), "hp2": W(1, highprio=True)})
    s = SliceScheduler(config, quantum=0.02)
    decision = s.step(0.0, {"hp": busy(1)})
    assert decision.holder == "hp"
    assert decision.armed == {"hp2"}


def test_a_holder_with_company_is_watched_for_idleness() -> None:
    """While another waits, the step a grace after the holder's last activity is
    only an idle check: the decision says so, and when to step otherwise."""
    s = scheduler("x", "y", idle_grace=0.002)
    granted = s.step(0.0, {"x": WAITING, "y": WAITING})
    assert granted.holder == "y"
    watch = granted.idle_watch
    assert watch is not None
    assert watch.holder == "y"
    assert (watch.at, watch.grace, watch.otherwise) == pytest.approx((0.002, 0.002, 0.02))
    assert watch.patience == pytest.approx(0.002), "x waits: a look every grace"
    assert granted.wake_at == pytest.approx(0.002)
    alone = scheduler("a").step(0.0, {"a": WAITING})
    assert alone.idle_watch is None, "nobody else wants the GPU: idleness changes nothing"


@pytest.mark.parametrize("policy", [Policy.FAIR_SHARE, Policy.WEIGHTED, Policy.FIXED])
def test_where_unused_time_stays_idle_a_lone_idle_holder_gives_the_gpu_up(
        policy: Policy) -> None:
    """Under 0, 2 and 3 a holder that went idle is closed even with nobody else
    waiting, and is charged until its answer, not for the idle time after it."""
    s = scheduler("a", "b", policy=policy, idle_grace=0.002)
    granted = s.step(0.0, {"a": WAITING})
    assert granted.idle_watch is not None, "watched alone too"
    assert granted.idle_watch.at == pytest.approx(0.002)
    # nobody else waits: while a stays busy its watch may look up to a quantum apart
    assert granted.idle_watch.patience == pytest.approx(0.02)
    s.step(0.001, {"a": busy(2)})
    s.step(0.003, {"a": Observation(launches=2)})
    assert state(s) == Draining("a", closed_at=0.003, paid_to=0.0)
    decision = s.step(0.0035, {"a": Observation(launches=2, answered=True)})
    assert state(s) == Idle()
    assert s.used()["a"] == pytest.approx(0.0035)
    assert "a" not in decision.armed, "it has not rested: its next launch rings"


@pytest.mark.parametrize("policy", [Policy.FAIR_SHARE, Policy.WEIGHTED, Policy.FIXED])
def test_a_lone_holder_with_the_whole_gpu_is_not_watched(policy: Policy) -> None:
    """Its share is the whole GPU (the other container has weight 0; max_inst
    1 under 0 and 3): nobody else may use the GPU, so its idle time is nobody's
    loss and it keeps the GPU, as where idle time is lent; once its share is
    less, its idleness gives the GPU up again."""
    config = GpuConfig(policy=policy, max_inst=1,
                       containers={"a": W(1), "b": W(0), "c": W(0)})
    s = SliceScheduler(config, quantum=0.02, drain_timeout=0.1, idle_grace=0.002)
    granted = s.step(0.0, {"a": WAITING})
    assert granted.idle_watch is None
    assert granted.wake_at == pytest.approx(0.02), "the first slice: a quantum"
    s.step(0.001, {"a": busy(2)})
    s.step(0.01, {"a": Observation(launches=2)})
    assert isinstance(state(s), Holding), "idle, alone, with the whole GPU"
    renewed = s.step(0.02, {"a": Observation(launches=2)})
    assert (renewed.holder, renewed.idle_watch) == ("a", None)
    assert renewed.wake_at == pytest.approx(0.02 + LONE_SLICE)
    s.configure(GpuConfig(policy=policy, max_inst=2,
                          containers={"a": W(1), "b": W(1), "c": W(0)}))
    halved = s.step(0.021, {"a": Observation(launches=2)})
    assert halved.open == frozenset()
    assert state(s) == Draining("a", closed_at=0.021, paid_to=0.02), "half the GPU: idle"


@pytest.mark.parametrize("policy", [Policy.PREEMPTIVE, Policy.SOFT])
def test_where_idle_time_is_lent_a_lone_idle_holder_keeps_the_gpu(policy: Policy) -> None:
    s = scheduler("a", "b", policy=policy, idle_grace=0.002)
    assert s.step(0.0, {"a": WAITING}).idle_watch is None
    s.step(0.001, {"a": busy(2)})
    s.step(0.01, {"a": Observation(launches=2)})
    assert isinstance(state(s), Holding)


def test_a_watched_holder_is_idle_from_when_it_was_last_seen_active() -> None:
    """`active_at`: the caller watched a launch at 0.004 and stepped at 0.0065,
    2.5 ms later: the holder (y, first by name) has been idle for its grace
    and gives up the GPU."""
    s = scheduler("x", "y", idle_grace=0.002)
    s.step(0.0, {"x": WAITING, "y": WAITING})
    seen = Observation(launches=5, active_at=0.004)
    s.step(0.0065, {"x": WAITING, "y": seen})
    assert state(s) == Draining("y", closed_at=0.0065, paid_to=0.0)
    # Without active_at the launches count as of the step: a is still busy.
    t = scheduler("x", "y", idle_grace=0.002)
    t.step(0.0, {"x": WAITING, "y": WAITING})
    kept = t.step(0.0065, {"x": WAITING, "y": Observation(launches=5)})
    assert kept.holder == "y"
    assert isinstance(state(t), Holding)
    assert kept.idle_watch is not None
    assert kept.idle_watch.at == pytest.approx(0.0085)


def test_a_holder_that_said_it_went_idle_quits_without_a_drain() -> None:
    """y's processes said they went idle at 0.003 (their work done, nothing
    launched since): at 0.0065 its turn ends at once, x is granted in the same
    step, and y is paid to 0.003, not for the grace and the report's way back."""
    s = scheduler("x", "y", idle_grace=0.002)
    s.step(0.0, {"x": WAITING, "y": WAITING})
    said = Observation(launches=5, active_at=0.003, idle=True)
    decision = s.step(0.0065, {"x": WAITING, "y": said})
    assert decision.holder == "x"
    assert isinstance(state(s), Holding)
    assert s.late_record("y") is None, "nothing left to drain"
    assert s.used()["y"] == pytest.approx(0.003)
    assert ("Holding", "quit", "Holding") in s.moves


def test_an_idle_report_that_a_launch_belies_is_not_believed() -> None:
    """y says it went idle at 0.001, but it launched after the step at 0.002
    had counted its launches: the report is taken back (as libcgpu's launch
    takes it back), y is active at the step, and it keeps the GPU."""
    s = scheduler("x", "y", idle_grace=0.002)
    s.step(0.0, {"x": WAITING, "y": WAITING})
    s.step(0.002, {"x": WAITING, "y": Observation(launches=3)})
    lying = Observation(launches=7, active_at=0.001, idle=True)
    kept = s.step(0.0045, {"x": WAITING, "y": lying})
    assert kept.holder == "y"
    assert state(s) == Holding("y", slice_start=0.0, slice_end=0.02, paid_to=0.0)
    assert kept.idle_watch is not None
    assert kept.idle_watch.at == pytest.approx(0.0065), "active at the step"


def test_active_at_cannot_move_a_container_forward_in_time() -> None:
    """A watch's time later than the step is the step's (a claim from the future
    buys nothing)."""
    s = scheduler("x", "y", idle_grace=0.002)
    s.step(0.0, {"x": WAITING, "y": WAITING})
    later = s.step(0.001, {"x": WAITING, "y": Observation(launches=1, active_at=5.0)})
    assert later.idle_watch is not None
    assert later.idle_watch.at == pytest.approx(0.003)


def test_a_holder_granted_while_a_preempting_one_could_not_run_keeps_its_slice() -> None:
    """hi (highprio, 0.8) runs its slice and answers late: 6 ms behind, it may
    not run, and lo is granted. hi's credit comes back within 2 ms, yet lo's
    slice is its turn: preempted at once, each of lo's turns was a sliver
    that paid a whole drain (`CAPPED_BESIDE_PREEMPTING` in test_slices.py)."""
    config = GpuConfig(policy=Policy.PREEMPTIVE, prio_ratio=80,
                       containers={"hi": W(1, highprio=True), "lo": W(1)})
    s = SliceScheduler(config, quantum=0.02, drain_timeout=0.1)
    assert s.step(0.0, {"hi": WAITING, "lo": WAITING}).holder == "hi"
    s.step(0.02, {"hi": busy(1), "lo": WAITING})
    assert state(s) == Draining("hi", closed_at=0.02, paid_to=0.02)
    s.step(0.03, {"hi": busy(1), "lo": WAITING})  # it answers 10 ms after the close
    assert s.credits()["hi"] == pytest.approx(0.8 * 0.03 - 0.03)
    assert state(s) == Holding("lo", slice_start=0.03, slice_end=0.05, paid_to=0.03,
                               keeps_slice=True)
    s.step(0.032, {"hi": busy(1), "lo": busy(1)})
    assert s.credits()["hi"] >= -0.02 * 0.25, "hi may run again"
    assert state(s) == Holding("lo", slice_start=0.03, slice_end=0.05, paid_to=0.03,
                               keeps_slice=True), "not preempted"
    s.step(0.05, {"hi": busy(1), "lo": busy(2)})
    assert state(s) == Draining("lo", closed_at=0.05, paid_to=0.05), "its slice ends as any"


def test_a_barred_container_is_granted_nothing_and_the_others_run_on_its_time() -> None:
    """An audit (`bar`): the barred one waits as if it did not, the others take
    turns on share credit they do not have, and the barred one is granted
    again once its bar ends; with nobody else to run, a bar ends at once."""
    s = scheduler("a", "b", "c")
    assert s.step(0.0, {"a": WAITING, "b": WAITING, "c": WAITING}).holder == "c"
    s.bar("a", until=0.3)
    t, launches, holders = 0.0, 0, set()
    while t < 0.29:  # b and c take turns; a is owed more and more, but barred
        t += 0.005
        launches += 1
        decision = s.step(t, {"a": WAITING, "b": busy(launches), "c": busy(launches)})
        assert "a" not in decision.open | decision.armed
        holders.add(decision.holder)
    assert holders == {"b", "c"}, "grants while a is barred"
    assert min(s.credits()["b"], s.credits()["c"]) < -0.02 * 0.25, "they run on a's time"
    assert s.barred == {"a"}
    for t in (0.3, 0.305, 0.31, 0.315, 0.32, 0.325):
        s.step(t, {"a": WAITING, "b": busy(launches), "c": busy(launches)})
    assert s.barred == frozenset()
    assert s.holder == "a", "owed the most, it takes its turns back"
    alone = scheduler("a", "b")
    alone.bar("a", until=1.0)
    assert alone.step(0.0, {"a": WAITING}).open == {"a"}, "nobody else may run: the bar ends"
    assert alone.barred == frozenset()
