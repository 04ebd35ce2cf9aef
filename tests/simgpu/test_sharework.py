"""sharework: the counting workload of the share measurements, on simgpu alone."""

from __future__ import annotations

import math
import signal
import subprocess
import time

import pytest

from tests.bench.shares import count, parse_report
from tests.simgpu.simhost import SimHost


def sharework(sim: SimHost, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([str(sim.lib_dir / "sharework"), *args], env=sim.env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_it_counts_what_the_gpu_can_complete(sim: SimHost) -> None:
    out = subprocess.run([str(sim.lib_dir / "sharework"), "--us", "1000", "--seconds", "1.5",
                          "--procs", "3"], env=sim.env(), capture_output=True, text=True,
                         timeout=30, check=True).stdout
    assert out.startswith("ready pid=")
    got = parse_report(out)
    # One engine, 1 ms kernels back to back: at most 1500 in 1.5 s, and no idle gaps.
    assert 1440 <= got.kernels <= 1500
    assert len(got.per_proc) == 3
    assert all(n >= 400 for n in got.per_proc)
    # Never two kernels at once. A completion is stamped when its process sees it, so a
    # process the host kept off the CPU for a few ms pushes as many kernels into the
    # next 100 ms window: serial is 100 a window, two at once would be 200, three 300.
    windows = [sum(got.buckets[i:i + 10]) for i in range(len(got.buckets) - 9)]
    print(f"the most kernels in a 100 ms window: {max(windows)}")
    assert max(windows) < 150
    assert count(got, got.t0 + 0.5, got.t0 + 1.5) in range(970, 1001)


def test_go_with_a_time_gives_the_shared_start(sim: SimHost) -> None:
    work = sharework(sim, "--us", "5000", "--seconds", "0.5", "--go-stdin")
    assert work.stdout is not None
    assert work.stdout.readline().startswith("ready ")
    at = time.monotonic() + 0.3
    out, err = work.communicate(f"go {at:.9f}\n", timeout=30)
    got = parse_report(out)
    assert got.t0 == pytest.approx(at, abs=2e-9)  # as the C side parsed and printed it
    assert 95 <= got.kernels <= 100, err


def test_sigterm_stops_it_early_with_its_counts(sim: SimHost) -> None:
    work = sharework(sim, "--us", "2000", "--seconds", "60", "--procs", "2")
    assert work.stdout is not None
    assert work.stdout.readline().startswith("ready ")
    time.sleep(0.5)  # some kernels to count
    sent = time.monotonic()
    work.send_signal(signal.SIGTERM)
    out, _ = work.communicate(timeout=30)  # a hang guard: its run was to last 60 s
    exited = time.monotonic()
    assert work.returncode == 0
    got = parse_report(out)
    print(f"stopped {exited - sent:.2f} s after SIGTERM, {got.kernels} kernels counted")
    assert got.kernels > 0
    assert got.kernels == sum(got.per_proc)
    # what it counted, it counted before it exited
    assert sum(got.buckets[math.ceil((exited - got.t0) / got.bucket):]) == 0


def test_bad_arguments_and_driver_errors(sim: SimHost) -> None:
    usage = sharework(sim, "--us", "10")  # no --seconds
    _, err = usage.communicate(timeout=10)
    assert usage.returncode == 2
    assert err.startswith("usage: sharework")
    bad = sharework(sim, "--us", "10", "--seconds", "1", "--device", "7")
    _, err = bad.communicate(timeout=10)
    assert bad.returncode == 1
    assert "cuDeviceGet: CUDA_ERROR_INVALID_DEVICE" in err
    assert "exited before it was ready" in err


def test_requests_are_timed_from_first_launch_to_synchronize(sim: SimHost) -> None:
    out = subprocess.run([str(sim.lib_dir / "sharework"), "--us", "1000", "--seconds", "1",
                          "--depth", "2", "--request-ms", "50", "--procs", "2"],
                         env=sim.env(), capture_output=True, text=True, timeout=30,
                         check=True).stdout
    got = parse_report(out)
    # two processes, a request every 50 ms each (spread 25 ms apart), 2 kernels each
    assert 36 <= len(got.latency_us) <= 40
    assert got.kernels == 2 * len(got.latency_us)
    # two 1 ms kernels take at least 2 ms; on an engine shared only with the other,
    # spread-out process, far less than the 50 ms between requests
    assert all(2000 <= us < 50000 for us in got.latency_us), got.latency_us


def test_it_keeps_depth_outstanding_on_each_stream(sim: SimHost) -> None:
    out = subprocess.run([str(sim.lib_dir / "sharework"), "--us", "5000", "--seconds", "1",
                          "--depth", "2", "--streams", "8"], env=sim.env(),
                         capture_output=True, text=True, timeout=30, check=True).stdout
    got = parse_report(out)
    # 16 kernels of 5 ms queued at once; completions are counted as each stream's
    # turn comes, so the second's count is the engine's 200 kernels, give or take a
    # round of the streams
    assert count(got, got.t0 + 0.2, got.t0 + 1.0) in range(150, 177)
    assert got.latency_us == ()
