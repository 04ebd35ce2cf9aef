"""A container that wakes owed time gets the GPU at once, whatever its neighbour queued.

In simulated time against the time-slicing GPU model (`slice_model`): an
interactive container sends a request of 2 x 1 ms kernels every 20 ms
beside a neighbour with long kernels. Every assertion counts kernels or
steps; none reads a clock.
"""

from __future__ import annotations

import pytest

from cgpu_km.sched import ContainerSpec, GpuConfig, Observation, Policy, SliceScheduler
from tests.sched.slice_model import Proc, kernels, run

W = ContainerSpec
NEIGHBOURS = {
    # 64 streams of 20 ms kernels, 2 deep: 128 kernels queued in its process
    "64 streams of 20 ms": lambda: Proc("nb", 0.02, depth=128),
    "single 50 ms": lambda: Proc("nb", 0.05, depth=1),
}


def interactive() -> Proc:
    # first request 5 ms in: the neighbour holds the GPU when it comes
    return Proc("int", 0.001, depth=2, every=0.02, next_request=0.005)


@pytest.mark.parametrize("policy", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("neighbour", sorted(NEIGHBOURS))
def test_a_request_waits_for_at_most_one_of_a_neighbours_kernels(policy: int,
                                                                  neighbour: str) -> None:
    config = GpuConfig(policy=Policy(policy), max_inst=2,
                       containers={"int": W(1), "nb": W(1)})
    nb, req = NEIGHBOURS[neighbour](), interactive()
    run(SliceScheduler(config), [nb, req], 3.0)
    done = [r for r in req.requests if r.end is not None]
    assert len(done) >= 145, "every request is served"
    # While a request was under way the neighbour finished at most the kernel it was
    # running: the request did not wait behind its queue.
    assert max(r.ran_meanwhile(0) for r in done) <= 1


@pytest.mark.parametrize("policy", [1, 2, 4])
def test_waking_keeps_the_neighbours_share(policy: int) -> None:
    """Taking the GPU at once costs the neighbour nothing of what the policy gives it:
    under 1 and 4 it gets what the interactive container leaves, under 2 its half."""
    config = GpuConfig(policy=Policy(policy), containers={"int": W(1), "nb": W(1)})
    procs = [Proc("nb", 0.001, depth=4), interactive()]
    got = kernels(run(SliceScheduler(config), procs, 4.0), procs)
    assert got["int"] / 4.0 == pytest.approx(0.1, abs=0.005), got
    want = 0.5 if policy == 2 else 0.9
    assert got["nb"] / 4.0 == pytest.approx(want, abs=0.03), got


def test_a_waking_container_is_granted_at_the_step_that_sees_it() -> None:
    config = GpuConfig(policy=Policy.PREEMPTIVE, containers={"a": W(1), "b": W(1)})
    scheduler = SliceScheduler(config, quantum=0.02)
    assert scheduler.step(0.0, {"a": Observation(waiting=True)}).holder == "a"
    busy = Observation(waiting=True, launches=3)
    taken = scheduler.step(0.005, {"a": busy, "b": Observation(waiting=True)})
    assert taken.open == {"b"}, "no wait for a's slice, nor for its drain"
    assert scheduler.late == {"a"}
    scheduler.step(0.009, {"a": Observation(waiting=True, launches=3, answered=True),
                           "b": Observation(waiting=True, launches=2)})
    # a paid from its grant until its answer, less half of the 4 ms the two shared,
    # which b paid
    assert scheduler.used()["a"] == pytest.approx(0.007)
    assert scheduler.used()["b"] == pytest.approx(0.002)


def test_a_container_waiting_on_past_its_turn_is_not_waking() -> None:
    """A busy container whose turn ended waits on at the gate: however much credit it
    gathers meanwhile, it waits for the holder's slice to end."""
    config = GpuConfig(policy=Policy.PREEMPTIVE, containers={"a": W(1), "b": W(1)})
    scheduler = SliceScheduler(config, quantum=0.02)
    both = {"a": Observation(waiting=True), "b": Observation(waiting=True)}
    first = scheduler.step(0.0, both).holder
    assert first is not None
    second = ({"a", "b"} - {first}).pop()
    for k in range(1, 20):  # the first holder's slice: the other, passed over, waits
        t = k * 0.001
        decision = scheduler.step(t, {first: Observation(waiting=True, launches=k),
                                      second: Observation(waiting=True)})
        assert decision.open == {first}


def test_a_container_owing_time_does_not_wake_into_the_gpu() -> None:
    config = GpuConfig(policy=Policy.WEIGHTED, containers={"a": W(1), "b": W(1)})
    scheduler = SliceScheduler(config, quantum=0.02)
    scheduler.restore({"accounts": {"b": {"credit": -0.05, "cap_credit": 0.0, "used": 0.0}}})
    assert scheduler.step(0.0, {"a": Observation(waiting=True)}).holder == "a"
    decision = scheduler.step(0.005, {"a": Observation(waiting=True, launches=3),
                                      "b": Observation(waiting=True)})
    assert decision.open == {"a"}, "b owes time: it waits its turn"


@pytest.mark.parametrize("policy", [1, 4])
def test_requests_are_not_late_when_each_step_comes_a_millisecond_after_the_ring(
        policy: int) -> None:
    """Eight interactive containers, their requests spread over the 20 ms (80% of the
    GPU's time in all), stepped 1 ms after each ring, as a loaded host's dispatcher
    may be: a launch through an armed gate does not wait for that step, so no request
    starts late (the model skips the request times a late one missed)."""
    n = 8
    procs = [Proc(f"i{i}", 0.001, depth=2, every=0.02, next_request=0.0005 + 0.02 * i / n)
             for i in range(n)]
    config = GpuConfig(policy=Policy(policy), containers={p.container: W(1) for p in procs})
    run(SliceScheduler(config), procs, 2.0, step_delay=0.001)
    started = {p.container: len(p.requests) for p in procs}
    assert started == {p.container: 100 for p in procs}


@pytest.mark.parametrize("policy", [0, 2, 3])
def test_where_unused_time_stays_idle_the_idle_gpu_costs_nobody(policy: int) -> None:
    """Four interactive containers, each owed a quarter and using a tenth, whose
    requests all come in the first half of every 20 ms: the GPU is idle in the
    second half. A holder that kept the GPU through it would pay for it, fall
    behind its share and wait for credit (requests 3 ms late, while the others
    run theirs); one that gives it up idle pays for its own work only."""
    n = 4
    procs = [Proc(f"i{i}", 0.001, depth=2, every=0.02, next_request=0.0005 + 0.01 * i / n)
             for i in range(n)]
    config = GpuConfig(policy=Policy(policy), max_inst=n,
                       containers={p.container: W(1) for p in procs})
    run(SliceScheduler(config), procs, 3.0)
    assert {p.container: len(p.requests) for p in procs} == {p.container: 150 for p in procs}
    for mine, proc in enumerate(procs):
        for request in proc.requests[:-1]:
            # beside each of the others, at most the request it had under way
            assert max(request.ran_meanwhile(other) for other in range(n)
                       if other != mine) <= 2


@pytest.mark.parametrize("policy", [1, 4])
def test_a_container_that_never_rests_does_not_wait_out_a_busy_slice(policy: int) -> None:
    """Eight processes take turns with the requests (one every 20 ms, each process's
    every 160 ms), so the container never rests; beside a busy neighbour of eight
    processes it is owed, and takes the GPU at once: a request waits at most for
    what the neighbour had queued (8 processes x 2), not for its slice (20 kernels)
    and then its queue. Past the first 0.3 s, in which that credit builds up."""
    config = GpuConfig(policy=Policy(policy), containers={"int": W(1), "nb": W(1)})
    busy = [Proc("nb", 0.001, depth=2) for _ in range(8)]
    serving = [Proc("int", 0.001, depth=2, every=0.16, next_request=0.005 + 0.02 * i)
               for i in range(8)]
    procs = busy + serving
    got = kernels(run(SliceScheduler(config), procs, 3.0), procs)
    done = [r for p in serving for r in p.requests if r.end is not None and r.start > 0.3]
    assert len(done) >= 130, "every request is served"
    assert max(sum(r.ran_meanwhile(i) for i in range(len(busy))) for r in done) <= 16
    assert got["int"] / 3.0 == pytest.approx(0.1, abs=0.005), got
    assert got["nb"] / 3.0 == pytest.approx(0.9, abs=0.05), got


@pytest.mark.parametrize("policy", [1, 4])
def test_a_process_that_rested_takes_the_gpu_from_the_first_request_on(policy: int) -> None:
    """As above, from the start: before credit builds up, a request that comes
    soon after the container's last one (which waited beside the neighbour's
    queue) finds the container not rested and not yet owed; but its process
    rested 160 ms, and takes the GPU at once. Without that, the first requests
    waited out the neighbour's slices (52 of its kernels) on a dispatcher that
    steps 1 ms after a ring."""
    config = GpuConfig(policy=Policy(policy), containers={"int": W(1), "nb": W(1)})
    busy = [Proc("nb", 0.001, depth=4) for _ in range(8)]
    serving = [Proc("int", 0.001, depth=2, every=0.16, next_request=0.005 + 0.02 * i)
               for i in range(8)]
    procs = busy + serving
    got = kernels(run(SliceScheduler(config), procs, 3.0, step_delay=0.001,
                      answer_delay=0.0005), procs)
    done = [r for p in serving for r in p.requests if r.end is not None]
    assert len(done) >= 145, "every request is served"
    # at most what the neighbour's processes had queued (8 x 4), never its slice too
    assert max(sum(r.ran_meanwhile(i) for i in range(len(busy))) for r in done) <= 32
    assert got["int"] / 3.0 == pytest.approx(0.1, abs=0.005), got
