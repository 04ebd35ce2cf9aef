"""simgpu's NVML utilization: sampled the way the driver samples it."""

from __future__ import annotations

import time
from itertools import pairwise
from typing import Any

from tests.simgpu.simhost import SimHost

PERIOD_US = 167_000
HALF = 100 * 2000 / 4050  # each of two busy processes: a 2 ms slice per 2 ms + 2 switches

READ = """
    nv = nvml()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    now_us = time.time_ns() // 1000
    def samples(since):
        try:
            return [[s.pid, s.timeStamp, s.smUtil]
                    for s in nv.nvmlDeviceGetProcessUtilization(h, since)]
        except nv.NVMLError_NotFound:
            return []
    out({"now": now_us, "window": samples(now_us - 1_000_000), "latest": samples(0),
         "gpu": nv.nvmlDeviceGetUtilizationRates(h).gpu})
    """


def _by_pid(rows: list[list[int]]) -> dict[int, list[list[int]]]:
    got: dict[int, list[list[int]]] = {}
    for pid, stamp, util in rows:
        got.setdefault(pid, []).append([stamp, util])
    return got


def _two_busy(sim: SimHost) -> list[int]:
    """Two processes sharing device 0 for seconds, and an idle one; the busy pids."""
    busy = [sim.start("--kernels", "400", "--us", "10000", "--go-stdin") for _ in range(2)]
    sim.start("--hold-stdin")
    for work in busy:
        work.go()
    time.sleep(1.2)
    return sorted(work.ready["pid"] for work in busy)


def test_process_samples_are_periodic_integer_and_biased(sim: SimHost) -> None:
    pids = _two_busy(sim)
    fixed: dict[str, Any] = sim.result(READ, SIMGPU_NVML_PROC_BIAS="1.0")
    halved: dict[str, Any] = sim.result(READ, SIMGPU_NVML_PROC_BIAS="0.5")
    drawn: dict[str, Any] = sim.result(READ)

    window = _by_pid(fixed["window"])
    assert sorted(window) == pids  # the idle process has no samples
    phases = set()
    for rows in window.values():
        stamps = [stamp for stamp, _ in rows]
        assert len(stamps) in (5, 6)  # one a period over the last second
        assert all(b - a == PERIOD_US for a, b in pairwise(stamps))
        assert fixed["now"] - 1_000_000 < stamps[0]
        assert stamps[-1] <= fixed["now"]
        assert all(isinstance(util, int) and abs(util - HALF) <= 2 for _, util in rows), rows
        phases.add(stamps[0] % PERIOD_US)
    assert len(phases) == 2  # each process samples on its own phase
    # timestamp 0: the latest completed sample of each, up to a period old
    latest = _by_pid(fixed["latest"])
    assert sorted(latest) == pids
    for pid, ((stamp, _),) in latest.items():
        assert fixed["now"] - PERIOD_US < stamp <= fixed["now"] + 200_000
        assert stamp % PERIOD_US == window[pid][0][0] % PERIOD_US
    assert fixed["gpu"] >= 98  # the device: all but the switches

    for rows in _by_pid(halved["window"]).values():
        assert all(abs(util - HALF / 2) <= 1.5 for _, util in rows), rows
    drawn_rows = _by_pid(drawn["window"])
    assert sorted(drawn_rows) == pids
    for rows in drawn_rows.values():
        utils = [util for _, util in rows]
        assert max(utils) - min(utils) <= 3, utils  # one factor per process
        assert all(0.7 * HALF - 2 <= util <= 1.4 * HALF + 2 for util in utils), utils


def test_exact_figures_on_request(sim: SimHost) -> None:
    pids = _two_busy(sim)
    got: dict[str, Any] = sim.result(READ, SIMGPU_NVML_EXACT="1")
    rows = sorted(got["window"])
    # One sample per process with a context, stamped now, its share since the timestamp.
    assert len(rows) == 3
    assert [row[0] for row in rows if row[2] > 0] == pids
    assert all(row[1] >= got["now"] for row in rows)
    assert all(abs(row[2] - HALF) <= 2 for row in rows if row[2] > 0)


def test_reading_lags_by_up_to_a_sample(sim: SimHost) -> None:
    got = sim.result(
        """
        def work(role, barrier):
            if role == 0:
                ctx(0)
                short, long = kernel(20000), kernel(400000)
                barrier()
                launch(short)
                ok(cu.cuCtxSynchronize())
                barrier()
                launch(long)
                started = time.time_ns() // 1000
                barrier()
                ok(cu.cuCtxSynchronize())
                return started
            nv = nvml()
            h = nv.nvmlDeviceGetHandleByIndex(0)
            def latest():
                try:
                    samples = nv.nvmlDeviceGetProcessUtilization(h, 0)
                    return [[s.timeStamp, s.smUtil] for s in samples]
                except nv.NVMLError_NotFound:
                    return []
            def sleep_until(us):
                time.sleep(max(0, us - time.time_ns() // 1000) / 1e6)
            barrier()
            while not latest():
                time.sleep(0.005)
            period = 300_000
            quiet = latest()[0][0] + 2 * period  # a sample of an idle period
            sleep_until(quiet + 20_000)
            before = latest()
            barrier()  # the child launches a 400 ms kernel
            time.sleep(0.03)
            just_started = latest()
            sleep_until(quiet + period + 20_000)
            after = latest()
            barrier()
            return {"quiet": quiet, "before": before, "just_started": just_started,
                    "after": after}
        started, seen = duo(work)
        seen["started"] = started
        out(seen)
        """,
        SIMGPU_NVML_SAMPLE_MS="300",
        SIMGPU_NVML_PROC_BIAS="1",
    )
    assert got["before"] == []
    assert got["just_started"] == []  # running, but its latest sample is older
    ((stamp, util),) = got["after"]
    assert stamp == got["quiet"] + 300_000
    expected = 100 * (stamp - got["started"]) / 300_000
    assert expected - 5 <= util <= expected + 1, (util, expected)


def test_a_slot_taken_by_a_new_process_of_the_same_recorded_pid_starts_clean(
        sim: SimHost) -> None:
    """A process records its pid in its own pid namespace when /proc is that
    namespace's (SIMGPU_PID here), so the one that takes a freed slot after it
    may record the same pid. NVML must not show the newcomer, which has run
    nothing, with what its predecessor ran (the daemon's compute check read
    that as a process running past its gate: issue 36)."""
    busy = sim.start("--kernels", "100", "--us", "10000", "--go-stdin", SIMGPU_PID="3")
    busy.go()
    busy.finish()  # it ran about a second, then exited: its slot is free
    idle = sim.start("--hold-stdin", SIMGPU_PID="3")
    got: dict[str, Any] = sim.result(READ, SIMGPU_NVML_PROC_BIAS="1.0")
    assert idle.ready["pid"] not in _by_pid(got["window"])
    assert idle.ready["pid"] not in _by_pid(got["latest"])
