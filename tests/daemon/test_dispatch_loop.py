"""The dispatcher's loop against a port in simulated time: how often it wakes
and stamps the heartbeat (counted in wakes and stamps; no clock is read)."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Mapping, Set
from dataclasses import replace
from pathlib import Path

import pytest

from cgpu_km.dataplane.dispatch import SPIN_PAUSE_NS, SPIN_WAITS, Dispatcher, raise_priority
from cgpu_km.sched import (
    ContainerSpec,
    GpuConfig,
    IdleWatch,
    Observation,
    Policy,
    SliceDecision,
)

SECOND = 1_000_000_000
GATES_FAIL_OPEN_NS = 2 * SECOND


class SimulatedPort:
    """Containers that launch without end (`busy`) or never; every wait lasts
    until its deadline, which moves the clock. Stops the dispatcher after
    `seconds`."""

    def __init__(self, busy: Set[str], idle: Set[str], seconds: float,
                 overrun_ns: int = 0) -> None:
        self.now = 10 * SECOND
        self.overrun_ns = overrun_ns  # how late each wait returns past its deadline
        self.end = self.now + int(seconds * SECOND)
        self.busy, self.idle = busy, idle
        self.launches = 0
        self.wakes = 0
        self.beats: list[int] = []
        self.dispatcher: Dispatcher | None = None

    def observe(self) -> Mapping[str, Observation]:
        self.launches += 1
        seen = {name: Observation(waiting=True, launches=self.launches) for name in self.busy}
        return {**seen, **{name: Observation() for name in self.idle}}

    def apply(self, open_: frozenset[str], now_ns: int, queue_ns: int = 0,
              armed: frozenset[str] = frozenset(), watch: IdleWatch | None = None,
              close_at: tuple[str, int] | None = None) -> None:
        pass

    def closes_at_end(self, name: str) -> bool:
        return False

    def heartbeat(self, now_ns: int) -> None:
        self.beats.append(now_ns)

    def wait(self, deadline_ns: int, quiet: Set[str], holder: str | None,
             answers_of: str | None = None) -> str | None:
        # one already past returns at once
        self.now = max(self.now + 1, deadline_ns + self.overrun_ns)
        self.wakes += 1
        if self.now >= self.end:
            assert self.dispatcher is not None
            self.dispatcher.stop()
        return None

    def kick(self) -> None:
        pass

    def open_all(self) -> None:
        pass


def run(busy: Set[str], idle: Set[str], seconds: float, overrun_ns: int = 0
        ) -> SimulatedPort:
    port = SimulatedPort(busy, idle, seconds, overrun_ns)
    config = GpuConfig(policy=Policy.SOFT, max_inst=4,
                       containers={n: ContainerSpec(weight=1) for n in busy | idle})
    port.dispatcher = Dispatcher(0, port, config, clock=lambda: port.now)
    port.dispatcher.run()
    return port


@pytest.mark.parametrize("busy", [set(), {"a"}], ids=["idle", "a lone holder"])
def test_the_heartbeat_stays_fresh_with_few_wakes(busy: set[str]) -> None:
    port = run(busy, {"b", "c"} - busy, seconds=60)
    gaps = [b - a for a, b in zip(port.beats, port.beats[1:], strict=False)]
    assert max(gaps) <= 3 * SECOND // 4, "at most 0.75 s between two heartbeats"
    assert max(gaps) < GATES_FAIL_OPEN_NS
    # Two wakes a second for the heartbeat, and of them one step: a lone
    # holder's renewal, or the look an idle GPU takes every second (a wake for
    # the heartbeat alone is not a step; before, each was: two a second).
    assert port.wakes <= 2 * 60 + 2, f"{port.wakes} wakes in 60 s"
    steps = port.launches  # one observation per step
    assert steps <= 60 + 2, f"{steps} steps in 60 s"


class ReconfiguringPort(SimulatedPort):
    """A SimulatedPort whose wait hands the dispatcher a new configuration once,
    `at` seconds in, as the daemon's tree thread does while it sleeps."""

    def __init__(self, config: GpuConfig, at: float) -> None:
        super().__init__({"a"}, {"b"}, seconds=2 * at)
        self.config, self.at = config, self.now + int(at * SECOND)
        self.handed: int | None = None  # the steps (observations) taken then

    def wait(self, deadline_ns: int, quiet: Set[str], holder: str | None,
             answers_of: str | None = None) -> str | None:
        ringer = super().wait(deadline_ns, quiet, holder, answers_of)
        if self.handed is None and self.now >= self.at:
            assert self.dispatcher is not None
            self.handed = self.launches
            self.dispatcher.configure(self.config)
        return ringer


def test_a_configuration_runs_at_the_next_step() -> None:
    # The promise "the daemon applies a change within one scheduling period", from
    # the dispatcher's record: the step that first ran with a new configuration.
    containers = {n: ContainerSpec(weight=1) for n in "ab"}
    config = GpuConfig(policy=Policy.FAIR_SHARE, max_inst=4, containers=containers)
    port = ReconfiguringPort(config, at=5)
    port.dispatcher = Dispatcher(0, port, GpuConfig(Policy.SOFT, 4, containers=containers),
                                 clock=lambda: port.now)
    assert port.dispatcher.figures().configured == (0, 0)
    port.dispatcher.run()
    assert port.handed is not None
    handed, ran = port.dispatcher.figures().configured
    assert handed == port.handed
    assert ran - handed == 1, "the next step runs a new configuration"
    assert port.dispatcher.scheduler.config is config


def test_the_dispatcher_records_how_late_it_woke_for_its_deadlines() -> None:
    # A loaded host (or the interpreter's lock) wakes the thread late: each wait here
    # returns 3 ms past its deadline, and the figure says so.
    port = run({"a"}, {"b"}, seconds=10, overrun_ns=3_000_000)
    assert port.dispatcher is not None
    wakes, seconds, most = port.dispatcher.figures().late
    assert wakes == port.wakes
    assert seconds == pytest.approx(wakes * 0.003)
    assert most == pytest.approx(0.003)
    punctual = run({"a"}, {"b"}, seconds=10).dispatcher
    assert punctual is not None
    assert punctual.figures().late[1] == 0


def in_a_thread(call: Callable[[], str]) -> tuple[str, str]:
    """`call` in a thread of its own (it names the calling thread): what it
    returned, and the thread's name as the kernel has it."""
    got: list[tuple[str, str]] = []

    def body() -> None:
        said = call()
        got.append((said, Path(f"/proc/self/task/{threading.get_native_id()}/comm")
                    .read_text().strip()))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return got[0]


def test_a_dispatcher_thread_asks_for_sched_fifo_and_is_named() -> None:
    asked: list[tuple[int, int, int]] = []

    def setscheduler(pid: int, policy: int, param: os.sched_param) -> None:
        asked.append((pid, policy, param.sched_priority))

    said, name = in_a_thread(lambda: raise_priority(1, 3, setscheduler=setscheduler))
    assert asked == [(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, 1)]  # 0: the calling thread
    assert (said, name) == ("SCHED_FIFO 1", "cgpu-gpu3")


def test_a_refused_priority_leaves_the_thread_as_it_was_and_says_why(
        caplog: pytest.LogCaptureFixture) -> None:
    def setscheduler(pid: int, policy: int, param: os.sched_param) -> None:
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    said, name = in_a_thread(lambda: raise_priority(5, 0, setscheduler=setscheduler))
    assert said == f"default policy (SCHED_FIFO 5 refused: {os.strerror(errno.EPERM)})"
    assert name == "cgpu-gpu0"
    assert [r.getMessage() for r in caplog.records] == [f"GPU 0: dispatcher under the {said}"]


def test_priority_zero_asks_for_nothing() -> None:
    def setscheduler(pid: int, policy: int, param: os.sched_param) -> None:
        raise AssertionError("asked for a policy")

    assert in_a_thread(lambda: raise_priority(0, 7, setscheduler=setscheduler)) == (
        "default policy", "cgpu-gpu7")


def test_a_scheduler_that_never_lets_it_sleep_is_paused() -> None:
    # A fault that makes every decision ask for the next step at once would leave a
    # SCHED_FIFO thread that never sleeps: after SPIN_WAITS such waits in a row, each
    # sleeps SPIN_PAUSE_NS (here the clock moves only as far as the waits sleep).
    port = SimulatedPort({"a"}, {"b"}, seconds=1)
    config = GpuConfig(policy=Policy.SOFT, max_inst=4,
                       containers={n: ContainerSpec(weight=1) for n in "ab"})
    port.dispatcher = Dispatcher(0, port, config, clock=lambda: port.now)
    scheduler = port.dispatcher.scheduler
    step = scheduler.step

    def eager(now: float, observed: Mapping[str, Observation]) -> SliceDecision:
        return replace(step(now, observed), wake_at=now)

    scheduler.step = eager  # type: ignore[method-assign]
    port.dispatcher.run()
    # 100 waits for nothing, then one a millisecond: about 1000 in the second
    assert SPIN_WAITS <= port.wakes <= SPIN_WAITS + SECOND // SPIN_PAUSE_NS + 2, port.wakes


ANSWER_NS = 1_000_000  # from a close (or the slice's end) to the drain's answer


class DrainingPort(SimulatedPort):
    """Two busy containers whose drains answer ANSWER_NS after their close;
    `closing`: their processes close themselves at the slice's end they were
    told, and answer that close ahead, with a ring (a ring is a wake here)."""

    def __init__(self, closing: bool, seconds: float, early: bool = False) -> None:
        super().__init__({"a", "b"}, set(), seconds)
        self.closing = closing
        self.early = early  # the holder answers its end ANSWER_NS after its grant
        self.open: frozenset[str] = frozenset()
        self.granted_at = 0
        self.told: tuple[str, int] | None = None
        self.answer_at: dict[str, int] = {}  # the answer to each one's last close

    def ahead(self) -> tuple[str, int] | None:
        """The holder closing itself, and when its answer comes."""
        if self.closing and self.told is not None and self.told[0] in self.open:
            return self.told[0], (self.granted_at if self.early else self.told[1]) + ANSWER_NS
        return None

    def observe(self) -> Mapping[str, Observation]:
        self.launches += 1
        ahead = self.ahead()
        return {n: Observation(waiting=True, launches=self.launches,
                               answered=self.now >= self.answer_at.get(n, 0),
                               closed_itself=ahead is not None and ahead[0] == n
                               and self.now >= ahead[1])
                for n in self.busy}

    def apply(self, open_: frozenset[str], now_ns: int, queue_ns: int = 0,
              armed: frozenset[str] = frozenset(), watch: IdleWatch | None = None,
              close_at: tuple[str, int] | None = None) -> None:
        ahead = self.ahead()
        for name in self.open - open_:
            answered_ahead = ahead is not None and ahead[0] == name and ahead[1] <= now_ns
            self.answer_at[name] = ahead[1] if answered_ahead and ahead else now_ns + ANSWER_NS
        if open_ - self.open or close_at != self.told:  # a grant, or a turn again
            self.granted_at = now_ns
        self.open, self.told = open_, close_at

    def closes_at_end(self, name: str) -> bool:
        return self.closing

    def wait(self, deadline_ns: int, quiet: Set[str], holder: str | None,
             answers_of: str | None = None) -> str | None:
        rings = {n: at for n, at in self.answer_at.items() if at > self.now and n not in quiet}
        if (ahead := self.ahead()) is not None and ahead[1] > self.now and ahead[0] not in quiet:
            rings[ahead[0]] = ahead[1]
        ringer = min(rings, key=rings.__getitem__, default=None)
        if ringer is None or rings[ringer] >= deadline_ns:
            return super().wait(deadline_ns, quiet, holder, answers_of)
        self.now = rings[ringer]
        self.wakes += 1
        if self.now >= self.end:
            assert self.dispatcher is not None
            self.dispatcher.stop()
        return ringer


@pytest.mark.parametrize("closing", [False, True], ids=["closed by the daemon", "closing"])
def test_a_holder_that_closes_itself_costs_one_wake_a_switch(closing: bool) -> None:
    """Two busy containers take turns: the dispatcher wakes at each slice's end
    to close it and again on the drain's answer; where the holder's processes
    close themselves at the end they were told, it wakes on the answer only,
    and the turns are as many and as long."""
    port = DrainingPort(closing, seconds=10)
    config = GpuConfig(policy=Policy.WEIGHTED,
                       containers={n: ContainerSpec(weight=1) for n in port.busy})
    dispatcher = port.dispatcher = Dispatcher(0, port, config, clock=lambda: port.now)
    dispatcher.run()
    figures = dispatcher.figures()
    per_switch = port.wakes / figures.switches
    print(f"{figures.switches} switches in 10 s, {per_switch:.2f} wakes a switch")
    assert figures.switches >= 10 / 0.022 * 0.95, "a turn is a quantum and a drain"
    if closing:
        assert per_switch < 1.1
        assert figures.moves["ended"] >= figures.switches - 1, figures.moves
    else:
        assert per_switch > 1.9
    assert figures.used["a"] == pytest.approx(figures.used["b"], rel=0.01)


def test_an_answer_before_the_end_is_taken_at_the_end() -> None:
    """A holder whose processes answer the end they were told long before it
    (a hostile one: libcgpu answers at the end) rang once; the dispatcher
    steps at the slice's end all the same, and the turn ends there, not at
    the drain limit after it."""
    port = DrainingPort(True, seconds=10, early=True)
    config = GpuConfig(policy=Policy.WEIGHTED,
                       containers={n: ContainerSpec(weight=1) for n in port.busy})
    dispatcher = port.dispatcher = Dispatcher(0, port, config, clock=lambda: port.now)
    dispatcher.run()
    figures = dispatcher.figures()
    assert figures.switches >= 10 / 0.022 * 0.95, figures.switches
    assert figures.moves["ended"] >= figures.switches - 1, figures.moves
    assert figures.used["a"] == pytest.approx(figures.used["b"], rel=0.01)
