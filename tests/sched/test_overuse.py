"""The compute check's rules: NVML-like samples against the scheduler's grants.

Samples are made here the way NVML makes them (and simgpu imitates): one per
process per period on a phase of its own, the percent of the period in which
it ran, times a bias of 0.7 to 1.4, whole percents capped at 100, none for a
period in which it did not run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from hypothesis import example, given, settings
from hypothesis import strategies as st

from cgpu_km.sched.grants import BLIND_AFTER, EVERYONE, SETTLE, GrantHistory, GrantLog
from cgpu_km.sched.overuse import Judge, Sample

PERIOD = 1 / 6
GPU = 0
A, B = (GPU, "a"), (GPU, "b")


def driving(*names: str) -> GrantLog:
    """A dispatcher's log that has driven these containers' gates for SETTLE at 0."""
    log = GrantLog(-SETTLE, horizon=60.0)
    log.record(-SETTLE, set(), driven=set(names))
    for beat in range(math.ceil(SETTLE / 0.5) + 1):  # the heartbeat, every 0.5 s
        log.alive(-SETTLE + 0.5 * beat)
    return log


def alternating(log: GrantLog, until: float, turns: dict[str, float], start: float = 0.0
                ) -> None:
    """Each container in `turns` holds the GPU for its turn, in order, until `until`."""
    t = start
    while t < until:
        for name, turn in turns.items():
            log.record(t, {name})
            for beat in range(1, math.ceil(turn / 0.5)):  # the heartbeat, every 0.5 s
                log.alive(t + 0.5 * beat)
            t += turn


def samples_of(history: GrantHistory, key: tuple[int, str], pid: int, until: float, *,
               run: float, bias: float, phase: float = 0.0, beside: float = 0.0,
               start: float = 0.0) -> list[Sample]:
    """NVML's samples of a process that runs `run` of the time its container may
    run, and `beside` of the rest (an attacker past the gate)."""
    found = []
    end = start + phase + PERIOD
    while end <= until:
        allowed = history.allowed(key[1], end - PERIOD, end)
        assert allowed is not None
        ran = run * allowed + beside * (PERIOD - allowed)
        percent = min(100, math.floor(100 * bias * ran / PERIOD))
        if percent:
            found.append(Sample(key, pid, end, percent))
        end += PERIOD
    return found


Judged = tuple[tuple[int, str], tuple[int, ...], bool]  # container, pids, ungranted


def judged(judge: Judge, history: GrantHistory, samples: list[Sample], until: float,
           launched_at: dict[tuple[tuple[int, str], int], float | None]) -> list[Judged]:
    """Every verdict of a check every half second, samples read as they come."""
    verdicts = []
    pending = sorted(samples, key=lambda s: s.end)
    now = 0.5
    while now <= until:
        judge.add(GPU, [s for s in pending if now - 0.5 < s.end <= now])
        verdicts += [(v.key, v.pids, v.ungranted)
                     for v in judge.judge(GPU, now, history, launched_at)]
        now += 0.5
    return verdicts


def test_the_log_answers_the_seconds_each_container_might_run() -> None:
    log = driving("a", "b")
    log.record(1.0, {"a"})
    log.record(2.0, {"a", "b"})
    log.record(3.0, set())
    history = log.history(3.5)
    assert history.allowed("a", 0.5, 3.5) == 2.0
    assert history.allowed("b", 0.5, 3.5) == 1.0
    assert history.allowed("b", 3.0, 3.5) == 0.0
    assert history.allowed("a", -2.0, 1.0) is None  # before the log began
    assert history.allowed("c", 0.5, 1.0) is None  # never driven: its gate may be open


def test_a_silent_dispatcher_is_a_blind_span_and_policy_5_is_unknown() -> None:
    log = driving("a", "b")
    log.record(0.5, {"a"})
    log.alive(0.5 + BLIND_AFTER + 0.5)  # the gates may have failed open meanwhile
    log.record(3.0, EVERYONE)
    log.alive(3.5)
    history = log.history(4.0)
    assert history.allowed("b", 0.1, 0.4) == 0.0
    assert history.allowed("b", 1.0, 1.5) is None
    assert history.allowed("b", 3.1, 3.5) is None
    assert log.history(4.0 + 2 * BLIND_AFTER).allowed("b", 3.9, 5.0) is None
    log.record(5.0, {"a"})  # policy 5 ends: what it queued may run on for SETTLE
    for beat in (5.5, 6.0, 6.5, 7.0):
        log.alive(beat)
    history = log.history(7.0)
    assert history.allowed("b", 5.0 + SETTLE - 0.1, 6.6) is None
    assert history.allowed("b", 5.0 + SETTLE + 0.1, 6.6) == 0.0


def test_a_container_is_known_from_settle_after_it_was_first_driven() -> None:
    log = driving("a")
    log.record(1.0, {"a"}, driven={"a", "b"})
    for beat in (1.5, 2.0, 2.5, 3.0):
        log.alive(beat)
    history = log.history(3.0)
    assert history.allowed("b", 1.0 + SETTLE - 0.1, 3.0) is None
    assert history.allowed("b", 1.0 + SETTLE, 3.0) == 0.0
    assert history.allowed("a", 0.5, 3.0) == 2.0


def test_an_honest_pair_at_one_to_one_read_high_is_never_judged() -> None:
    log = driving("a", "b")
    alternating(log, 12.0, {"a": 0.02, "b": 0.02})
    history = log.history(12.0)
    samples = (samples_of(history, A, 10, 12.0, run=1.0, bias=1.4, phase=0.05)
               + samples_of(history, B, 20, 12.0, run=1.0, bias=1.4, phase=0.11))
    judge = Judge()
    assert judged(judge, history, samples, 12.0, {(A, 10): 11.9, (B, 20): 11.9}) == []


def test_a_process_past_a_cap_is_judged_and_its_honest_neighbour_is_not() -> None:
    """`a` is capped at a tenth (its grants: 20 ms of every 200); one of its processes
    runs past the gate half the time, read as low as NVML may read it."""
    log = driving("a", "b")
    alternating(log, 12.0, {"a": 0.02, "b": 0.18})
    history = log.history(12.0)
    samples = (samples_of(history, A, 10, 12.0, run=0.5, bias=1.4, phase=0.03)
               + samples_of(history, A, 11, 12.0, run=0.0, beside=0.5, bias=0.7, phase=0.07)
               + samples_of(history, B, 20, 12.0, run=0.5, bias=1.0, phase=0.13))
    verdicts = judged(Judge(), history, samples, 12.0,
                      {(A, 10): 11.9, (A, 11): None, (B, 20): 11.9})
    assert verdicts
    assert verdicts[0] == (A, (11,), False)
    assert all(pids == (11,) for _key, pids, _outside in verdicts)
    assert len(verdicts) == 1  # judged once, then left out


def test_use_while_no_grant_at_all_is_judged_whatever_it_reads() -> None:
    """`b` holds the GPU alone for a second at a time; `a`'s attacker runs then too."""
    log = driving("a", "b")
    alternating(log, 12.0, {"a": 0.5, "b": 1.0})
    history = log.history(12.0)
    samples = (samples_of(history, A, 10, 12.0, run=1.0, bias=1.4, phase=0.02)
               + samples_of(history, A, 11, 12.0, run=0.1, beside=0.1, bias=0.7, phase=0.09))
    verdicts = judged(Judge(), history, samples, 12.0, {(A, 10): 11.9, (A, 11): 11.9})
    assert verdicts == [(A, (11,), True)]


def test_a_thief_that_reads_low_beside_busy_grants_is_judged_by_an_audit() -> None:
    """At 1:1 a process of `a` runs past the gate in `b`'s turns, read at 0.7: `a`
    reads 0.7 * 0.75 of the GPU against grants of 0.5, which the first rule allows.
    The check wants `a` audited (a process no audit has seen); in the audit `a` is
    granted nothing for 2.5 periods while `b` holds the GPU, and the thief shows."""
    log = driving("a", "b")
    alternating(log, 4.0, {"a": 0.02, "b": 0.02})
    history = log.history(4.0)
    thief = samples_of(history, A, 11, 4.0, run=0.0, beside=0.5, bias=0.7, phase=0.07)
    honest = samples_of(history, A, 10, 4.0, run=1.0, bias=1.4, phase=0.03)
    judge = Judge()  # over its grants, by the first rule, but who did it?
    assert judged(judge, history, thief + honest, 4.0, {(A, 10): 3.9, (A, 11): 3.9}) == []
    assert set(judge.audits_wanted(GPU)) == {A}
    log.record(4.0, {"b"})  # the audit: b holds, a is barred
    log.record(4.0 + judge.audit_length(GPU), {"a"})
    alternating(log, 8.0, {"a": 0.02, "b": 0.02}, start=4.0 + judge.audit_length(GPU))
    history = log.history(8.0)
    thief = samples_of(history, A, 11, 8.0, run=0.0, beside=0.5, bias=0.7, phase=0.07)
    honest = samples_of(history, A, 10, 8.0, run=1.0, bias=1.4, phase=0.03)
    verdicts = judged(Judge(), history, thief + honest, 8.0, {(A, 10): 7.9, (A, 11): 7.9})
    assert verdicts == [(A, (11,), True)]


def audits_asked(judge: Judge, history: GrantHistory, samples: list[Sample], until: float,
                 launched_at: Mapping[tuple[tuple[int, str], int], float | None]
                 ) -> list[tuple[float, str]]:
    """When a check every quarter second asked for an audit of `a`, and why."""
    asked = []
    pending = sorted(samples, key=lambda s: s.end)
    now = 0.25
    while now <= until:
        judge.add(GPU, [s for s in pending if now - 0.25 < s.end <= now])
        assert judge.judge(GPU, now, history, launched_at) == []
        if A in (wanted := judge.audits_wanted(GPU)):
            asked.append((now, wanted[A]))
        now += 0.25
    return asked


def test_an_honest_container_whose_use_of_its_grants_swings_is_not_audited() -> None:
    """`a`'s one process uses all of its turns for 2 s, then 0.35 of them for 2 s (its
    host's CPU taken), and so on for a minute. Its 2 s figures swing from 0.25 to 0.7
    of its grants: asked against the least since its last audit, as the check once
    did, that is a rise; over 6 s against its whole past, it is none."""
    log = driving("a", "b")
    alternating(log, 60.0, {"a": 0.02, "b": 0.02})
    history = log.history(60.0)
    samples = samples_of(history, B, 20, 60.0, run=1.0, bias=1.0, phase=0.11)
    for start in range(0, 60, 2):
        samples += samples_of(history, A, 10, start + 2.0, run=1.0 if start % 4 else 0.35,
                              bias=0.7, phase=0.05, start=float(start))
    launched = {(A, 10): 59.9, (B, 20): 59.9}
    assert audits_asked(Judge(), history, samples, 60.0, launched) == []


def test_a_thief_that_forges_its_launches_is_audited_when_its_samples_rise() -> None:
    """From 20 s a second process of `a`, its launch count forged, runs in half of `b`'s
    turns. Both read at 0.7: `a` reads 0.7 * 0.75 of the GPU against grants of 0.5,
    which the first rule allows, and no process looks like it skipped the gate; its
    samples rose from 0.7 to 1.05 of its grants, and that asks for the audit."""
    log = driving("a", "b")
    alternating(log, 40.0, {"a": 0.02, "b": 0.02})
    history = log.history(40.0)
    samples = (samples_of(history, A, 10, 40.0, run=1.0, bias=0.7, phase=0.05)
               + samples_of(history, A, 11, 40.0, run=0.0, beside=0.5, bias=0.7, phase=0.09,
                            start=20.0)
               + samples_of(history, B, 20, 40.0, run=1.0, bias=1.0, phase=0.11))
    launched = {(A, 10): 39.9, (A, 11): 39.9, (B, 20): 39.9}
    asked = audits_asked(Judge(), history, samples, 40.0, launched)
    assert asked, "no audit asked for"
    at, why = asked[0]
    print(f"asked at {at} s: {why}")
    assert 20.0 < at <= 20.0 + 6.0 + 1.0  # within the rise window and a period after
    assert why.startswith("its samples rose from 0.69")


def test_a_busy_container_is_audited_every_audit_every_seconds_without_a_sign() -> None:
    """No sign at all: an honest pair at 1:1. With `audit_every` of 3 s, `a` is asked
    for once it has been busy that long, whatever the rise's longer window knows."""
    log = driving("a", "b")
    alternating(log, 5.0, {"a": 0.02, "b": 0.02})
    history = log.history(5.0)
    samples = (samples_of(history, A, 10, 5.0, run=1.0, bias=1.0, phase=0.05)
               + samples_of(history, B, 20, 5.0, run=1.0, bias=1.0, phase=0.11))
    launched = {(A, 10): 4.9, (B, 20): 4.9}
    asked = audits_asked(Judge(audit_every=3.0), history, samples, 5.0, launched)
    assert asked, "no audit asked for"
    assert asked[0][1] == "none for 3 s"
    assert 3.0 < asked[0][0] <= 4.0


def test_audits_are_asked_for_a_process_that_skips_the_gate_and_once_passed_not_again(
        ) -> None:
    """Honest processes that launch through the gate are never audited for it; one
    that runs on the GPU with no launch through the gate is, once: after a quiet
    span of `a` that the samples cover, it has passed."""
    log = driving("a", "b")
    alternating(log, 4.0, {"a": 0.02, "b": 0.02})
    history = log.history(4.0)
    honest = samples_of(history, A, 10, 4.0, run=1.0, bias=1.4, phase=0.03)
    judge = Judge()
    assert judged(judge, history, honest, 4.0, {(A, 10): 3.9}) == []
    assert set(judge.audits_wanted(GPU)) == set()
    idle = samples_of(history, A, 12, 4.0, run=0.2, bias=1.0, phase=0.05, start=3.0)
    judge.add(GPU, idle)
    judge.judge(GPU, 3.5, history, {(A, 10): 3.4, (A, 12): None})
    assert set(judge.audits_wanted(GPU)) == set()  # suspected, not for long enough yet
    judge.judge(GPU, 4.0, history, {(A, 10): 3.9, (A, 12): None})
    assert set(judge.audits_wanted(GPU)) == {A}
    log.record(4.0, {"b"})  # the audit
    log.record(4.0 + judge.audit_length(GPU), {"a"})
    alternating(log, 6.0, {"a": 0.02, "b": 0.02}, start=4.0 + judge.audit_length(GPU))
    history = log.history(6.0)
    later = samples_of(history, A, 12, 6.0, run=0.2, bias=1.0, phase=0.05, start=4.0)
    judge.add(GPU, [s for s in later if s.end > 4.0])
    for now in (5.0, 5.5, 6.0):
        judge.judge(GPU, now, history, {(A, 10): now, (A, 12): None})
        assert set(judge.audits_wanted(GPU)) == set()


def test_nothing_is_judged_where_the_gates_may_have_failed_open() -> None:
    log = driving("a", "b")
    log.record(0.0, {"b"})
    log.alive(0.4)
    log.alive(12.0)  # silent for 11.6 s: the gates failed open
    history = log.history(12.0)
    samples = [Sample(A, 11, 0.5 + k * PERIOD, 90) for k in range(60)]
    assert judged(Judge(), history, samples, 12.0, {(A, 11): None}) == []


def test_the_sample_period_is_bounded_by_the_samples_spacing() -> None:
    judge = Judge()
    assert judge.periods(GPU) == (PERIOD, 1.0)  # NVML's documented range
    judge.add(GPU, [Sample(A, 10, 1.0 + k * 0.5, 50) for k in range(10)])
    assert judge.periods(GPU) == (PERIOD, 0.5)  # a process that ran every third period
    judge.add(GPU, [Sample(B, 20, 1.0 + k * 0.1, 50) for k in range(10)])
    low, high = judge.periods(GPU)
    assert math.isclose(low, 0.1)
    assert math.isclose(high, 0.1)


@given(turns=st.lists(st.floats(0.005, 1.0), min_size=2, max_size=8),
       runs=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=4),
       biases=st.lists(st.floats(0.7, 1.4), min_size=2, max_size=4),
       phases=st.lists(st.floats(0.0, PERIOD), min_size=2, max_size=4))
@example(turns=[0.125, 0.125, 0.25, 0.25], runs=[0.0, 1.0], biases=[1.0, 1.0],
         phases=[0.0, 0.0])  # the period was once learned from a resting process's gaps
@example(turns=[0.1484375, 0.3515625], runs=[1.0, 0.0], biases=[1.0, 1.0],
         phases=[0.0, 0.0])  # one sample every third period: the period is not the spacing
@example(turns=[0.25, 0.25], runs=[1.0, 0.0, 1.0], biases=[1.4, 1.4, 1.4],
         phases=[0.0, 0.0, 0.0])  # two processes of one container
@example(turns=[0.02, 0.02], runs=[1.0, 1.0], biases=[1.4, 1.4], phases=[0.0, 0.0])
@example(turns=[0.4, 0.005], runs=[1.0, 1.0], biases=[1.4, 1.4], phases=[0.1, 0.0])
@settings(deadline=None)
def test_honest_processes_are_never_judged(turns: list[float], runs: list[float],
                                           biases: list[float], phases: list[float]) -> None:
    """Containers take turns of any lengths; each process runs any part of its
    container's turns (its processes together at most all of them), never
    outside them, and is read as high as NVML may read it: nothing is judged."""
    names = [f"c{i}" for i in range(len(turns))]
    log = driving(*names)
    alternating(log, 8.0, dict(zip(names, turns, strict=True)))
    history = log.history(8.0)
    samples = []
    launched: dict[tuple[tuple[int, str], int], float | None] = {}
    processes = list(zip(runs, biases, phases, strict=False))
    ran: dict[str, float] = {}  # a container's processes share its turns
    for index, (run, _bias, _phase) in enumerate(processes):
        ran[names[index % len(names)]] = ran.get(names[index % len(names)], 0.0) + run
    for index, (run, bias, phase) in enumerate(processes):
        name = names[index % len(names)]
        key = (GPU, name)
        samples += samples_of(history, key, index, 8.0, run=run / max(1.0, ran[name]),
                              bias=bias, phase=phase)
        launched[key, index] = 7.9
    assert judged(Judge(), history, samples, 8.0, launched) == []


def test_work_through_an_armed_gate_counts_from_the_step_that_armed_it() -> None:
    """A starved host: `b` looked rested (its process slow to come back to its gate),
    so each step armed its gate. Its process woke at 2.01 and queued 80 ms of
    kernels through the armed gate, run beside the holder `a`; the dispatcher,
    starved too, stepped next only at 2.19, saw the launches and handed over
    (`a` draining until 2.25). `b` might have run since the step at 2.1 that
    armed its gate; before 2.19 nobody knows whether it did. (Counted from
    2.19 only, a check at 2.18 judged it ungranted, and later ones past its
    grants.)"""
    log = driving("a", "b")
    steps = [round(0.1 * k, 1) for k in range(22)]
    for step in steps:  # the dispatcher steps every 0.1 s, and arms b each time
        log.record(step, {"a"}, armed={"b"})
    early = log.history(2.18)
    assert early.allowed("b", 2.0, 2.18) == 0.0
    assert not early.settled("b", 2.2)
    assert early.settled("b", 2.1)
    assert early.settled("a", 2.2)
    assert early.quiet("b", 1.0, 2.18) == [(1.0, 2.1)]
    log.record(2.19, {"a", "b"})  # b's launches seen; a draining
    log.record(2.25, {"b"})
    log.alive(2.75)
    log.record(3.0, {"a"}, armed=set())
    late = log.history(3.0)
    assert math.isclose(late.allowed("b", 2.0, 2.19) or 0.0, 0.09)
    assert late.settled("b", 3.0)

    def ran(begin: float, end: float) -> float:
        """b's kernel time in [begin, end]: half of [2.01, 2.17] beside a, all of
        its turn (half while a drains)."""
        def part(a: float, b: float, share: float) -> float:
            return share * max(0.0, min(b, end) - max(a, begin))
        return part(2.01, 2.17, 0.5) + part(2.19, 2.25, 0.5) + part(2.25, 3.0, 1.0)

    samples = [Sample(B, 20, end, min(100, math.floor(100 * 1.4 * ran(end - PERIOD, end)
                                                      / PERIOD)))
               for end in (k * PERIOD for k in range(1, 19))]
    samples = [s for s in samples if s.percent]
    judge = Judge()
    verdicts = []
    for now, history in ((2.18, early), (2.5, late), (3.0, late)):
        judge.add(GPU, [s for s in samples if now - 0.5 < s.end <= now])
        verdicts += judge.judge(GPU, now, history, {(B, 20): now})
    assert verdicts == []


def test_an_armed_gate_counts_for_settle_at_most_before_the_step_that_saw_it() -> None:
    """An idle dispatcher armed `b` and slept 0.8 s before the ring of its launch:
    the launch may have gone through at any time since, but what went through
    counts for SETTLE before that step at most, as it does after it."""
    log = driving("a", "b")
    log.record(1.0, {"a"}, armed={"b"})
    log.alive(1.5)
    log.record(1.8, {"a", "b"})
    history = log.history(1.8)
    assert history.allowed("b", 1.0, 1.8 - SETTLE) == 0.0
    assert math.isclose(history.allowed("b", 1.0, 1.8) or 0.0, SETTLE)


def test_work_through_an_armed_gate_runs_for_settle_though_the_next_step_closes_it() -> None:
    """`b`'s armed gate let a launch through; the step that sees it closes the gate
    (`a` keeps the GPU): what went through runs anyway, so `b` may run from the
    arming step until SETTLE after the step that saw it, and not after."""
    log = driving("a", "b")
    log.record(1.0, {"a"}, armed={"b"})
    log.record(1.1, {"a"}, launched={"a", "b"})
    log.record(1.2, {"a"}, launched={"a"})
    log.record(1.1 + SETTLE + 0.05, {"a"})
    log.record(2.0, {"a"})
    history = log.history(2.0)
    assert math.isclose(history.allowed("b", 0.9, 2.0) or 0.0, 0.1 + SETTLE + 0.05)
    assert history.quiet("b", 1.0, 2.0) == [(1.1 + SETTLE + 0.05, 2.0)]
    assert history.allowed("a", 1.0, 2.0) == 1.0
    unarmed = driving("a", "b")
    unarmed.record(1.0, {"a"})
    unarmed.record(1.1, {"a"}, launched={"b"})  # a launch the gate did not arm: no grant
    assert unarmed.history(2.0).allowed("b", 1.0, 2.0) == 0.0


def test_a_thief_behind_a_gate_that_stays_armed_is_judged_a_step_later() -> None:
    """`b` never launches through its gate, so each step arms it again; a process of
    it runs beside the holder anyway. A sample past the last step waits for the
    next one, and is judged then."""
    log = driving("a", "b")
    judge = Judge()
    thief = [Sample(B, 21, 2.0 + k * PERIOD, 50) for k in range(13)]
    for k in range(31):
        log.record(round(0.1 * k, 1), {"a"}, armed={"b"})
    history = log.history(3.0)
    assert not history.settled("b", 3.01)
    judge.add(GPU, thief)
    verdicts = judge.judge(GPU, 3.0, history, {(B, 21): None})
    assert [(v.key, v.pids, v.ungranted) for v in verdicts] == [(B, (21,), True)]


@given(step=st.floats(0.01, 0.25), late=st.floats(0.0, 0.25), launch=st.floats(1.0, 2.0),
       work=st.floats(0.01, 0.32), bias=st.floats(0.7, 1.4), phase=st.floats(0.0, PERIOD),
       handover=st.floats(0.0, 0.1))
@example(step=0.1, late=0.18, launch=2.01, work=0.16, bias=1.4, phase=0.0, handover=0.06)
@settings(deadline=None)
def test_honest_work_through_an_armed_gate_is_never_judged(
        step: float, late: float, launch: float, work: float, bias: float, phase: float,
        handover: float) -> None:
    """`a` holds; every step arms `b`, until `b`'s process queues `work` of kernels
    through its armed gate at `launch` (run beside `a`, half the time each). The
    dispatcher's next step comes `late` after the launch, sees it and hands the
    GPU over (`a` draining for `handover`). Checks every quarter second, each
    with the log as it stood then: nothing is judged."""
    steps = [round(k * step, 6) for k in range(math.ceil(launch / step))]
    seen = launch + late
    events: list[tuple[float, set[str], set[str]]] = [(t, {"a"}, {"b"}) for t in steps]
    events += [(seen, {"a", "b"}, set()), (seen + handover, {"b"}, set()),
               (3.0, {"b"}, set())]
    beside_until = launch + 2 * work  # b's work, half the time until it is granted alone
    alone = seen + handover

    def ran(begin: float, end: float) -> float:
        def part(a: float, b: float, share: float) -> float:
            return share * max(0.0, min(b, end) - max(a, begin))
        if beside_until <= alone:
            return part(launch, beside_until, 0.5) + part(alone, 3.0, 1.0)
        return part(launch, alone, 0.5) + part(alone, 3.0, 1.0)

    samples = []
    end = phase + PERIOD
    while end <= 3.0:
        percent = min(100, math.floor(100 * bias * ran(end - PERIOD, end) / PERIOD))
        if percent:
            samples.append(Sample(B, 20, end, percent))
        end += PERIOD
    judge = Judge()
    now = 0.25
    while now <= 3.0:
        log = driving("a", "b")
        for at, who, armed in events:
            if at <= now:
                log.record(at, who, armed=armed)
        log.alive(now)
        judge.add(GPU, [s for s in samples if now - 0.25 < s.end <= now])
        assert judge.judge(GPU, now, log.history(now), {(B, 20): now}) == []
        now += 0.25
