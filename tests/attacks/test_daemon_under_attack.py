"""Attacks on the daemon's own working: a slow OOM script, and a fuzzed account part.

Issue 13, attacks 8 and 11. Shares are what `sharework` completed in its
container, counted in 10 ms buckets (`tests.bench.shares`), compared with a
fixed target: a 1 ms kernel stands for 1 ms of the GPU, so a container
alone completes about 1000 a second (`fraction` 1.0).
"""

from __future__ import annotations

import time

import pytest

from cgpu_km import region as region_mod
from tests.attacks.node import MIB, Node, ShareJob, fields, missing, sharing, wait_for
from tests.attacks.test_backstop import STOPPED, cgpu_mem
from tests.attacks.test_oom_and_memsize import egpu_env
from tests.bench.shares import count, fraction

pytestmark = [pytest.mark.root, pytest.mark.skipif(missing() is not None, reason=str(missing()))]

US = 1000
SLOW_SCRIPT = "#!/bin/sh\n: > /out/started\nsleep 3\n"


def heartbeat_age(region: region_mod.Region) -> float:
    """Seconds since the daemon last stamped this region's heartbeat."""
    return (time.monotonic_ns() - region.heartbeat_ns) / 1e9


def test_a_slow_oom_script_stalls_no_heartbeat_and_no_cap(node: Node) -> None:
    """Attack 8: while the daemon stops an eGPU container's process (its OOM script sleeps
    3 s), an unrelated container under fair share 1/4 stays capped and every heartbeat
    stays fresh."""
    node.echo("0/policy", 0)
    node.echo("0/max_inst", 4)
    node.start_daemon()
    slow = node.container(egpu_env(512, "/slow-oom.sh"), files={"/slow-oom.sh": SLOW_SCRIPT})
    capped = node.container(cgpu_mem(512))
    holder = slow.proc()
    assert holder.ask(f"alloc {400 * MIB}") == "alloc rc=0"
    wait_for(lambda: node.meminfo(slow)[1] == {holder.host_pid: 400 * MIB}, 3,
             "the daemon measuring the eGPU container")
    job = ShareJob(capped, US, 6)
    regions = [capped.region(), slow.region()]
    ages: list[float] = []
    started = slow.out / "started"
    with sharing([job]) as t0:
        time.sleep(max(0.0, t0 + 1.5 - time.monotonic()))
        node.echo(f"0/{slow.id12}/memsize", 256 * MIB)
        wait_for(started.exists, 3, "the OOM script starting", step=0.01)
        script_start = time.monotonic()
        while holder.alive() and time.monotonic() < script_start + 6:
            ages += [heartbeat_age(region) for region in regions]
            time.sleep(0.05)
        script_end = time.monotonic()
    report = job.report(timeout=30)
    for region in regions:
        region.close()
    assert holder.wait(1) == STOPPED
    assert script_end - script_start >= 2.8  # the script did run its 3 s
    assert max(ages) < 0.6  # stamped every 0.25 s; gates fail open at 2 s
    before = fraction(report, US, t0 + 0.5, script_start)
    during = fraction(report, US, script_start, script_end)
    assert before == pytest.approx(0.25, abs=0.03)
    assert during == pytest.approx(0.25, abs=0.03)


def snapshot_mtime(node: Node) -> int:
    return (node.state_dir / "snapshot.json").stat().st_mtime_ns


def test_fuzzing_the_account_from_inside_changes_nothing_for_the_neighbours(
    node: Node
) -> None:
    """Attack 11: root in a container writes random bytes at random offsets of its account
    part, and slots that look like processes waiting, launching and answering closes with
    random figures (ringing the doorbell), and tries the control part, for 3 s, on the GPU
    where two other containers share 1:2 (weighted policy, all three registered)."""
    node.echo("0/policy", 2)
    node.start_daemon()
    first = node.container({**cgpu_mem(512), "ALIYUN_COM_GPU_SCHD_WEIGHT": "1"})
    second = node.container({**cgpu_mem(512), "ALIYUN_COM_GPU_SCHD_WEIGHT": "2"})
    hostile = node.container({**cgpu_mem(512), "ALIYUN_COM_GPU_SCHD_WEIGHT": "1"}, user=0)
    fuzzer = hostile.proc()
    jobs = [ShareJob(first, US, 6), ShareJob(second, US, 6)]
    with sharing(jobs) as t0:
        time.sleep(max(0.0, t0 + 1.5 - time.monotonic()))
        fuzz_start = time.monotonic()
        answer = fields(fuzzer.ask("fuzz 3 20261130", timeout=15))
        fuzz_end = time.monotonic()
        published = snapshot_mtime(node)
    a, b = (job.report(timeout=30) for job in jobs)
    assert int(answer["writes"]) > 100_000
    assert answer["control_writes"] == "0"
    assert node.daemon_alive()
    wait_for(lambda: snapshot_mtime(node) > published, 3, "the daemon publishing again")
    for start, end in ((t0 + 0.5, fuzz_start), (fuzz_start, fuzz_end)):
        shares = (fraction(a, US, start, end), fraction(b, US, start, end))
        assert shares == pytest.approx((0.25, 0.5), abs=0.04), (start - t0, end - t0)
    during = (count(a, fuzz_start, fuzz_end), count(b, fuzz_start, fuzz_end))
    assert during[1] / during[0] == pytest.approx(2.0, rel=0.08)
    for second_start in (fuzz_start, fuzz_start + 1, fuzz_start + 2):  # gates keep opening
        assert min(count(r, second_start, second_start + 1) for r in (a, b)) > 100
