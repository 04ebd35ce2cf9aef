"""The stops service: every stop of the node, each in a task and a thread of its
own, so that no stop ever waits for another.

A stop is asked for with `Stops.request(key, pid, reason=..., oom_script=...)`
by the memory service (a process over its container's limit: "memory"; one
that holds GPU memory without libcgpu: "bypass") and by the compute check
("compute"). It goes:

1. the process is pinned (a pidfd) if the kernel still puts it in the
   container (`Plane.target`, in the stop's own thread);
2. with an OOM script (eGPU; memory stops, and only a process's first stop):
   the process is frozen at once (SIGSTOP), then waits, frozen, for a turn
   among the `oom_scripts` scripts the node runs at once, at most
   `stop_deadline` less `oom_script_timeout` (past it the script is not run);
   the script then runs at most `oom_script_timeout`, after which it and
   everything it started are killed. A slow script buys its process nothing:
   it does not run meanwhile, and it is killed within `stop_deadline`;
3. SIGKILL, which a frozen process gets too; without a script, at once;
4. the process is looked at until it is gone, at most `GONE_WAIT`.

A stop that did not see its process go (a process the kernel holds in an
uninterruptible wait; a pin given up after `stop_deadline`) ends; the memory
service asks for it again in each of its rounds while NVML lists the process,
and the retry sends SIGKILL at once. `request` refuses a stop of a process
whose stop is still under way. Each stop that sent a SIGKILL ends with a
journal line that says when each step came, counted from when the stop was
asked for (the daemon's detection): `gone 0.012 s after it was found`.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any, TypeVar

import trio

from cgpu_km.daemon.context import Blocking, Settings
from cgpu_km.daemon.edges import Plane, ScriptRun, StopTarget
from cgpu_km.dataplane.stopping import ScriptResult, printable, quoted_lines
from cgpu_km.tree.views import Key

log = logging.getLogger("cgpu-daemon")

T = TypeVar("T")
REASONS = ("memory", "bypass", "compute")
POLL = 0.01  # how often a running OOM script, and a killed process, are looked at
GONE_WAIT = 1.0  # seconds a stop looks for its process to be gone after SIGKILL
HISTORY = 1024  # finished stops kept in `records`
TRIES = 4096  # processes whose stops are remembered (a retry runs no OOM script)
OUTPUT_LINES = 3  # lines of an OOM script's output in the journal


@dataclass(eq=False)
class StopRecord:
    """One stop, as it went (times: the trio clock, seconds)."""

    key: Key
    pid: int
    reason: str
    requested: float  # when it was asked for: the daemon's detection
    attempt: int = 1  # 2 and more: a retry
    script: str = ""  # the OOM script, when one was due
    frozen: float | None = None
    script_started: float | None = None
    script_ended: float | None = None
    script_outcome: str = ""  # "exit 0", "killed at its 5 s deadline", "not run: ..."
    killed: float | None = None  # SIGKILL sent
    gone: float | None = None  # the process seen gone
    outcome: str = ""  # "stopped", "not the container's", "still there", "given up"

    def since(self, at: float | None) -> str:
        return "-" if at is None else f"+{at - self.requested:.3f} s"

    def describe(self) -> str:
        """Each step of the stop, counted from its request."""
        steps = []
        if self.frozen is not None:
            steps.append(f"frozen at {self.since(self.frozen)}")
        if self.script:
            if self.script_started is not None:
                steps.append(f"OOM script {printable(self.script)} from "
                             f"{self.since(self.script_started)} to "
                             f"{self.since(self.script_ended)} ({self.script_outcome})")
            else:
                steps.append(f"OOM script {printable(self.script)} {self.script_outcome}")
        steps.append(f"SIGKILL at {self.since(self.killed)}")
        return ", ".join(steps)


@dataclass
class _Tries:
    attempts: int = 0
    counted: bool = False


class Stops:
    """The node's stops (see the module). `serve` runs them; `request` starts one."""

    def __init__(self, plane: Plane, settings: Settings, *,
                 blocking: Blocking[Any] | None = None) -> None:
        """`blocking`: runs each stop's blocking steps (tests pass one that runs
        them inline); without it each stop has a thread of its own."""
        self.plane = plane
        self.settings = settings
        self._blocking = blocking
        self._scripts = trio.CapacityLimiter(settings.oom_scripts)
        self._in_flight: set[tuple[Key, int]] = set()
        self._counts: dict[str, dict[Key, int]] = {reason: {} for reason in REASONS}
        self._tries: collections.OrderedDict[tuple[Key, int], _Tries] = \
            collections.OrderedDict()
        self.records: collections.deque[StopRecord] = collections.deque(maxlen=HISTORY)
        self._nursery: trio.Nursery | None = None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def request(self, key: Key, pid: int, *, reason: str, oom_script: bool) -> bool:
        """Start a stop of host pid `pid` of container `key` (from trio, at once).
        False when a stop of it is already under way. `reason`: "memory",
        "bypass" or "compute"; `oom_script`: the container's OOM script first,
        when it has one (eGPU), unless this is a retry."""
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {', '.join(REASONS)}, not {reason!r}")
        if self._nursery is None:
            raise RuntimeError("the stops service is not serving")
        if (key, pid) in self._in_flight:
            return False
        tries = self._tries.pop((key, pid), None) or _Tries()
        tries.attempts += 1
        self._tries[key, pid] = tries
        while len(self._tries) > TRIES:
            self._tries.popitem(last=False)
        self._in_flight.add((key, pid))
        record = StopRecord(key, pid, reason, trio.current_time(), attempt=tries.attempts)
        self._nursery.start_soon(self._stop, record, oom_script and tries.attempts == 1)
        return True

    def in_flight(self, key: Key, pid: int) -> bool:
        """Whether a stop of (`key`, `pid`) is under way."""
        return (key, pid) in self._in_flight

    def under_way(self) -> frozenset[tuple[Key, int]]:
        """Every stop under way."""
        return frozenset(self._in_flight)

    def counts(self, reason: str) -> Mapping[Key, int]:
        """Processes stopped (sent SIGKILL) for `reason`, by container."""
        return MappingProxyType(self._counts[reason])

    async def _stop(self, record: StopRecord, oom_script: bool) -> None:
        key, pid = record.key, record.pid
        own = trio.CapacityLimiter(1)  # this stop's thread, shared with no other stop
        target: StopTarget | None = None
        try:
            with trio.move_on_after(self.settings.stop_deadline) as scope:
                target = await self._call(own, partial(self._pin, key, pid, oom_script),
                                          discard=lambda found: found.close() if found else None)
            if scope.cancelled_caught:
                record.outcome = "given up"
                log.warning("container %s on GPU %d: pinning pid %d for its stop took over %g "
                            "s: given up (the next memory round tries again)", key[1], key[0],
                            pid, self.settings.stop_deadline)
                return
            if target is None:
                record.outcome = "not the container's"
                self._tries.pop((key, pid), None)
                log.debug("pid %d is no process of %s on GPU %d (any more): nothing to stop",
                          pid, key[1], key[0])
                return
            if target.oom_script:
                await self._script(record, target, own)
            self._kill(record, target)
            await self._until_gone(record, target)
        finally:
            if target is not None:
                if record.killed is None:  # cancelled on the way: the stop was decided
                    self._kill(record, target)
                target.close()
            self._in_flight.discard((key, pid))
            self.records.append(record)
        if record.outcome == "stopped":
            log.info("container %s on GPU %d: pid %d stopped (%s): gone %.3f s after it was "
                     "found; %s", key[1], key[0], pid, record.reason,
                     (record.gone or 0.0) - record.requested, record.describe())

    def _pin(self, key: Key, pid: int, oom_script: bool) -> StopTarget | None:
        return self.plane.target(key, pid, oom_script=oom_script)

    async def _call(self, own: trio.CapacityLimiter, fn: Callable[[], T],
                    discard: Callable[[T], object] | None = None) -> T:
        """A blocking step of one stop, in that stop's own thread. Cancelled (the
        stop's deadline, the daemon's exit), the thread is left to finish alone,
        and `discard` takes what it returns (a pinned process, a script started)."""
        if self._blocking is not None:
            result: T = await self._blocking(fn)
            return result
        abandoned = False
        lock = threading.Lock()

        def step() -> T:
            found = fn()
            with lock:
                if abandoned and discard is not None and found is not None:
                    discard(found)
            return found

        try:
            return await trio.to_thread.run_sync(step, limiter=own, abandon_on_cancel=True)
        except trio.Cancelled:
            with lock:
                abandoned = True
            raise

    def _kill(self, record: StopRecord, target: StopTarget) -> None:
        target.kill()
        record.killed = trio.current_time()
        tries = self._tries.get((record.key, record.pid))
        if tries is None or not tries.counted:
            counts = self._counts[record.reason]
            counts[record.key] = counts.get(record.key, 0) + 1
            if tries is not None:
                tries.counted = True

    async def _until_gone(self, record: StopRecord, target: StopTarget) -> None:
        key, pid = record.key, record.pid
        with trio.move_on_after(GONE_WAIT):
            while True:
                if target.gone():
                    break
                await trio.sleep(POLL)
            record.gone = trio.current_time()
            record.outcome = "stopped"
            self._tries.pop((key, pid), None)
            return
        record.outcome = "still there"
        log.warning("container %s on GPU %d: pid %d still there %g s after SIGKILL (%s; "
                    "%s): the next memory round tries again", key[1], key[0], pid, GONE_WAIT,
                    record.reason, record.describe())

    async def _script(self, record: StopRecord, target: StopTarget,
                      own: trio.CapacityLimiter) -> None:
        """Freeze the process, run its OOM script in a turn of the node's pool,
        within its deadline; whatever happens, the caller kills the process next."""
        key, pid = record.key, record.pid
        timeout = self.settings.oom_script_timeout
        turn_wait = max(0.0, self.settings.stop_deadline - timeout)
        record.script = target.oom_script
        target.freeze()
        record.frozen = trio.current_time()
        with trio.move_on_after(turn_wait) as waiting:
            await self._scripts.acquire_on_behalf_of(record)
        if waiting.cancelled_caught:
            record.script_outcome = f"not run: no turn in {turn_wait:g} s"
            log.warning("container %s on GPU %d: OOM script %s for pid %d not run: the node's "
                        "%d OOM scripts at a time left it no turn in %g s", key[1], key[0],
                        printable(target.oom_script), pid, self._scripts.total_tokens,
                        turn_wait)
            return
        try:
            record.script_started = trio.current_time()
            try:
                run = await self._call(own, partial(target.start_script, timeout),
                                       discard=lambda started: started.end())
            except OSError as error:
                record.script_outcome = f"failed: {error}"
                log.warning("container %s on GPU %d: OOM script %s for pid %d failed: %s",
                            key[1], key[0], printable(target.oom_script), pid, error)
                return
            await self._until_ended(run, record.script_started + timeout)
            result = await self._call(own, run.end)
            record.script_ended = trio.current_time()
        finally:
            self._scripts.release_on_behalf_of(record)
        self._report(record, result, timeout)

    @staticmethod
    async def _until_ended(run: ScriptRun, deadline: float) -> None:
        try:
            while True:
                left = deadline - trio.current_time()
                if run.ended() or left <= 0:
                    break
                await trio.sleep(min(POLL, left))
        except BaseException:
            run.kill()
            raise

    def _report(self, record: StopRecord, result: ScriptResult, timeout: float) -> None:
        """The script's end and output in the journal: the script's words quoted,
        each line under its container and pid, never as the daemon's own."""
        key, pid = record.key, record.pid
        head = (f"container {key[1]} on GPU {key[0]}: OOM script {printable(record.script)} "
                f"for pid {pid}")
        status = result.status
        if status is None:
            record.script_outcome = f"killed at its {timeout:g} s deadline"
            log.warning("%s ran past its %g s deadline: killed, with what it started", head,
                        timeout)
        elif status == 125:
            why = " ".join(result.report.split()) or "status 125"
            record.script_outcome = "not run"
            log.warning("%s not run: %s", head, printable(why))
        else:
            record.script_outcome = f"exit {status}"
            if status != 0:
                log.warning("%s exited with status %d", head, status)
        lines = quoted_lines(result.output, lines=OUTPUT_LINES)
        if lines:
            more = result.written - len(result.output)
            if more > 0 or len(lines) == OUTPUT_LINES:
                log.info("%s wrote %d bytes; its last lines follow", head, result.written)
            for line in lines:
                log.info("%s said: %s", head, line)
