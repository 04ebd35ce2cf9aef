"""simgpu's engine: time slices between processes, as a GPU without MPS."""

from __future__ import annotations

import signal
import time

from tests.simgpu.simhost import SimHost

SHARE_CODE = """
    def work(role, barrier):
        os.environ["SIMGPU_QUEUE_DEPTH"] = "2" if role == 0 else "64"
        ctx(0)
        fn = kernel(1000)
        barrier()
        start = record()
        t0 = time.monotonic()
        ends = []
        while time.monotonic() < t0 + 1.5:
            launch(fn)
            ends.append(record())
        ok(cu.cuCtxSynchronize())
        return {"t0": t0, "done": [t0 + elapsed_ms(start, e) / 1000 for e in ends]}
    shallow, deep = duo(work)
    begin = max(shallow["t0"], deep["t0"]) + 0.3
    def count(r):
        return sum(begin <= t < begin + 1.0 for t in r["done"])
    out([count(shallow), count(deep)])
    """


def test_share_does_not_follow_queue_depth(sim: SimHost) -> None:
    shallow, deep = sim.result(SHARE_CODE)
    assert abs(shallow / deep - 1) <= 0.03, (shallow, deep)
    # Together they keep the engine busy but for the switches (25 us per 2 ms slice).
    assert 0.96 * 1000 * 2000 / 2025 <= shallow + deep <= 1000, (shallow, deep)


def test_fifo_engine_shares_by_queue_depth(sim: SimHost) -> None:
    shallow, deep = sim.result(SHARE_CODE, SIMGPU_SCHED="fifo")
    assert shallow / deep < 0.2, (shallow, deep)


def test_long_kernel_is_preempted_at_slice_ends(sim: SimHost) -> None:
    got = sim.result(
        """
        def work(role, barrier):
            ctx(0)
            fn = kernel(50 if role == 0 else 20000)
            barrier()
            ends = []
            if role == 0:
                # 120 ms of 50 us kernels; the launch loop blocks on the queue
                # (1024), so about 50 ms of them are still queued when it ends.
                start = record()
                for _ in range(2400):
                    launch(fn)
                    ends.append(record())
            barrier()
            host_ms = 0.0
            if role == 1:
                t0 = time.monotonic()
                start = record()
                launch(fn)
                host_ms = (time.monotonic() - t0) * 1000
                ends.append(record())
            ok(cu.cuCtxSynchronize())
            return [elapsed_ms(start, e) for e in ends], host_ms
        (small, _), ((long,), host_ms) = duo(work)
        gaps = [b - a for a, b in zip(small, small[1:])]
        out({"long": long, "host_ms": host_ms, "gaps": [g for g in gaps if g > 0.1]})
        """
    )
    # The 20 ms kernel ran in 10 slices of 2 ms; the small kernels ran in
    # between, each gap being one of its slices plus two switches.
    assert len(got["gaps"]) == 10
    assert all(2.09 <= gap <= 2.11 for gap in got["gaps"]), got["gaps"]
    # 20 ms, 9 slices of the other, 19 switches, up to a slice to get in, and the
    # host's time between recording the start and launching (measured there).
    assert 20 + 9 * 2 + 19 * 0.025 - 0.01 <= got["long"] \
        <= 20 + 10 * 2 + 20 * 0.025 + got["host_ms"] + 0.01, got


def _ms_per_kernel(sim: SimHost, runners: int, **env: str) -> list[float]:
    """Each runner's steady time per 1 ms kernel, 300 of them each."""
    code = f"""
    def work(role, barrier):
        ctx(0)
        fn = kernel(1000)
        barrier()
        if role < 2 - {runners}:
            return None
        start = record()
        ends = []
        for _ in range(300):
            launch(fn)
            ends.append(record())
        ok(cu.cuCtxSynchronize())
        done = [elapsed_ms(start, e) for e in ends]
        return (done[250] - done[50]) / 200
    out([r for r in duo(work) if r is not None])
    """
    return sim.result(code, **env)  # type: ignore[no-any-return]


def test_context_switches_cost_engine_time(sim: SimHost) -> None:
    (alone,) = _ms_per_kernel(sim, 1)
    assert abs(alone - 1) < 0.001
    # Two busy processes: 2 ms slices, each after a 25 us switch.
    pair = _ms_per_kernel(sim, 2)
    assert all(abs(ms - 2.025) < 0.002 for ms in pair), pair
    loss = 1 - sum(1 / ms for ms in pair)
    assert 0.010 <= loss <= 0.015, loss  # 25/2025 = 1.23 %
    # Free switches: no loss, whatever the slice.
    free = _ms_per_kernel(sim, 2, SIMGPU_CTX_SWITCH_US="0", SIMGPU_TIMESLICE_US="1000")
    assert all(abs(ms - 2) < 0.002 for ms in free), free


def test_zero_length_kernels_complete_at_once(sim: SimHost) -> None:
    busy = sim.start("--kernels", "100", "--us", "10000", "--go-stdin")
    busy.go()
    got = sim.result(
        """
        ctx(0)
        zero, ten = kernel(0), kernel(10000)
        s = ctypes.c_void_p(); ok(cu.cuStreamCreate(ctypes.byref(s), 1))
        launch(zero, s)
        first = cu.cuStreamQuery(s)
        launch(ten, s); launch(zero, s)
        behind = cu.cuStreamQuery(s)
        ok(cu.cuStreamSynchronize(s))
        out([first, behind, cu.cuStreamQuery(s)])
        """
    )
    # Its own queue was empty: done, though another process holds the engine;
    # behind a 10 ms kernel, it waits for that one.
    assert got == [0, 600, 0]


def test_waits_across_devices_and_host_functions(sim: SimHost) -> None:
    for sched in ("timeslice", "fifo"):
        got = sim.result(
            """
            c1 = ctx(1)
            long = kernel(30000)
            t0 = time.monotonic()
            launch(long)
            on_1 = record()
            c0 = ctx(0)
            short = kernel(1000)
            s = ctypes.c_void_p(); ok(cu.cuStreamCreate(ctypes.byref(s), 1))
            ok(cu.cuStreamWaitEvent(s, on_1, 0))
            launch(short, s)
            called = []
            HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
            cb = HOSTFN(lambda _: called.append(time.monotonic()))
            ok(cu.cuLaunchHostFunc(s, cb, None))
            ok(cu.cuStreamSynchronize(s))
            synced = time.monotonic()
            time.sleep(0.05)
            out([synced - t0, called[0] - t0 if called else None])
            """,
            SIMGPU_SCHED=sched,
        )
        synced, called = got
        assert synced >= 0.031, (sched, got)  # 30 ms on device 1, then 1 ms here
        assert called is not None, (sched, got)
        assert called >= 0.031, (sched, got)


def test_dead_process_work_vanishes(sim: SimHost) -> None:
    """A kernel launched after a process with 3 s of queued work was killed takes
    its own 10 ms on the engine (events time it), not a wait behind that work."""
    code = """
        nv = nvml(); h = nv.nvmlDeviceGetHandleByIndex(0)
        procs = len(nv.nvmlDeviceGetComputeRunningProcesses(h))  # reaps the dead one
        ctx(0)
        fn = kernel(10000)
        t0 = time.monotonic()
        start = record()
        launch(fn)
        host_ms = (time.monotonic() - t0) * 1000
        end = record()
        ok(cu.cuEventSynchronize(end))
        out([procs, elapsed_ms(start, end), host_ms])
        """
    for sched in ("timeslice", "fifo"):
        work = sim.start("--kernels", "300", "--us", "10000", "--go-stdin", SIMGPU_SCHED=sched)
        work.go()
        time.sleep(0.1)
        work.process.send_signal(signal.SIGKILL)
        work.process.wait()
        procs, ms, host_ms = sim.result(code, SIMGPU_SCHED=sched)
        print(f"{sched}: a 10 ms kernel after the kill took {ms:.2f} ms")
        assert procs == 0, sched
        if sched == "timeslice":
            # its own 10 ms after what the host took, and less than a slice (2 ms) of
            # anyone else's: the dead process's kernels would have shared the engine
            assert 10 <= ms < 10 + host_ms + 1, (sched, ms, host_ms)
        else:
            # The fifo engine had booked the dead process's kernels: they run on.
            assert ms > 10 + host_ms + 1, (sched, ms, host_ms)
