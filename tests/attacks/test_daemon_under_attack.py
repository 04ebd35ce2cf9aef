"""Attacks on the daemon's own working: a slow OOM script, and a fuzzed account part.

Issue 13, attacks 8 and 11. Shares are what `sharework` completed in its
container, counted in 10 ms buckets (`tests.bench.shares`), compared with a
fixed target: a 1 ms kernel stands for 1 ms of the GPU, so a container
alone completes about 1000 a second (`fraction` 1.0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from cgpu_km.dataplane import region as region_mod
from tests.attacks.node import (
    MIB,
    RAW,
    Node,
    ShareJob,
    built_node,
    fields,
    image_with,
    missing,
    sharing,
    wait_for,
)
from tests.attacks.test_backstop import STOPPED, cgpu_mem
from tests.attacks.test_oom_and_memsize import egpu_env
from tests.bench.shares import Report, count, fraction, window_counts
from tests.daemon.simbox import held_at

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing()))]

US = 1000
# After the fuzz its process exits, and the others are repaid what it owed then: a turn
# of up to a quantum and the drain limit (0.52 s) beyond its share, of which they are
# owed 0.39 s, taken from the idle quarter it leaves (policy 2) in 1.6 s.
REPAID = 3.0
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
    stamps: list[set[int]] = [set() for _ in regions]
    started = slow.out / "started"
    with sharing([job]) as t0:
        time.sleep(max(0.0, t0 + 1.5 - time.monotonic()))
        node.echo(f"0/{slow.id12}/memsize", 256 * MIB)
        wait_for(started.exists, 3, "the OOM script starting", step=0.01)
        script_start = time.monotonic()
        while holder.alive() and time.monotonic() < script_start + 6:
            ages += [heartbeat_age(region) for region in regions]
            for seen, region in zip(stamps, regions, strict=True):
                seen.add(region.heartbeat_ns)
            time.sleep(0.05)
        script_end = time.monotonic()
    report = job.report(timeout=30)
    for region in regions:
        region.close()
    assert holder.wait(1) == STOPPED
    assert script_end - script_start >= 2.8  # the script did run its 3 s
    print(f"the oldest heartbeat seen while the script ran: {max(ages):.2f} s "
          "(stamped every 0.25 s; gates fail open at 2 s)")
    # stamped on while the script ran: the dispatchers wait for no stop
    started_ns = int(script_start * 1e9)
    assert all(len({ns for ns in seen if ns > started_ns}) >= 2 for seen in stamps), stamps
    before = fraction(report, US, t0 + 0.5, script_start)
    during = fraction(report, US, script_start, script_end)
    # Capped: never above its 1/4 (failed-open gates would give it the whole GPU); a little
    # below it while the script's interpreter competes for this host's two cores.
    assert held_at(before, 0.25), before
    assert held_at(during, 0.25), during
    assert during == pytest.approx(before, abs=0.04)


def snapshot_mtime(node: Node) -> int:
    return (node.state_dir / "snapshot.json").stat().st_mtime_ns


@dataclass(frozen=True)
class FuzzRun:
    """Two containers sharing 1:2 while a third fuzzes its account part; what they counted."""

    first: Report
    second: Report
    t0: float
    start: float  # of the fuzz
    end: float
    answer: dict[str, str]  # the fuzzer's
    daemon_alive: bool
    published_after: bool  # a snapshot newer than the fuzz's end came

    def shares(self, start: float, end: float) -> tuple[float, float]:
        """The GPU's time that each container's kernels filled in [start, end)."""
        return (fraction(self.first, US, start, end), fraction(self.second, US, start, end))

    def shares_repaid(self) -> tuple[float, float]:
        """`shares` over the fuzz and the REPAID seconds after it."""
        return self.shares(self.start, self.end + REPAID)

    def fewest(self, width: float) -> int:
        """The fewest kernels either completed in a window of `width` seconds of the fuzz
        (windows 0.5 s apart)."""
        windows = window_counts([self.first, self.second], self.start, self.end, width, 0.5)
        return min(min(pair) for pair in windows)


def fuzz_beside_two(node: Node, seconds: float, mode: str) -> FuzzRun:
    """Weighted policy: containers of weight 1 and 2 run sharework, and root in a third
    (weight 1, on the same GPU, using no GPU) fuzzes its account part for `seconds`,
    from 2.5 s after their start (2 s of shares to compare with), then exits, REPAID
    + 1 s before their end."""
    node.echo("0/policy", 2)
    node.start_daemon()
    first = node.container({**cgpu_mem(512), "ALIYUN_COM_GPU_SCHD_WEIGHT": "1"})
    second = node.container({**cgpu_mem(512), "ALIYUN_COM_GPU_SCHD_WEIGHT": "2"})
    hostile = node.container({**cgpu_mem(512), "ALIYUN_COM_GPU_SCHD_WEIGHT": "1"}, user=0)
    fuzzer = hostile.proc()
    jobs = [ShareJob(sharer, US, seconds + 3.5 + REPAID) for sharer in (first, second)]
    with sharing(jobs) as t0:
        time.sleep(max(0.0, t0 + 2.5 - time.monotonic()))
        start = time.monotonic()
        answer = fields(fuzzer.ask(f"fuzz {seconds} 20261130 {mode}", timeout=seconds + 10))
        end = time.monotonic()
        fuzzer.send("exit")
        published = snapshot_mtime(node)
    a, b = (job.report(timeout=30) for job in jobs)
    alive = node.daemon_alive()
    try:
        wait_for(lambda: snapshot_mtime(node) > published, 3, "a new snapshot")
        published_after = True
    except AssertionError:
        published_after = False
    return FuzzRun(a, b, t0, start, end, answer, alive, published_after)


def held_at_both(shares: tuple[float, float]) -> bool:
    """Whether the weight-1 and weight-2 containers hold their fixed 1/4 and 1/2 (the
    idle third's quarter is given to nobody under policy 2), as `held_at` bounds a cap:
    the fuzzer's CPU load can take a little from them, never give them more."""
    first, second = shares
    return held_at(first, 0.25) and held_at(second, 0.5)


def assert_daemon_unharmed(run: FuzzRun) -> None:
    assert int(run.answer["writes"]) > 100_000
    assert run.answer["control_writes"] == "0"  # the control part refused every write
    assert run.daemon_alive
    assert run.published_after


def test_random_bytes_in_the_account_change_nothing_for_the_neighbours(node: Node) -> None:
    """Attack 11: root in a container writes random bytes at random offsets of everything
    it can open under /run/cgpu for 3 s (the account part; the control part refuses).
    Random bytes may make a live slot that waits and answers late, a liar that may
    overdraw a turn before its debt bars it, so the shares count the repayment too, as
    `test_forged_slots_cost_the_neighbours_nothing` does."""
    run = fuzz_beside_two(node, 3, "bytes")
    assert_daemon_unharmed(run)
    assert held_at_both(run.shares(run.t0 + 0.5, run.start))
    assert held_at_both(run.shares_repaid())
    during = (count(run.first, run.start, run.end), count(run.second, run.start, run.end))
    assert during[1] / during[0] == pytest.approx(2.0, rel=0.08)
    # Gates keep opening: in any 2 s, 500 and 1000 due. (Not any 1 s: an honest
    # neighbour may be audited on a sign, its samples risen against its grants, and
    # is then barred for 0.42 s, which it takes back after; at 3a76863 as now, two
    # runs in three audited one, and one in five left it 146 to 150 of 250 in a second.)
    assert run.fewest(2.0) > 300


@pytest.fixture(scope="module")
def forged_run(attack_tree: Path, attack_rootfs: Path) -> FuzzRun:
    """The fuzz with forged slots: live, waiting, launching, and answering closes with
    random drain times (often late, dated early), the doorbell rung at each, for 6 s."""
    with built_node(attack_tree, attack_rootfs) as node:
        return fuzz_beside_two(node, 6, "slots")


def test_forged_drain_answers_do_not_starve_the_neighbours(forged_run: FuzzRun) -> None:
    """Attack 11, harder: slots that answer closes late with an early drain time. Before
    the daemon dated answers no earlier than it saw them missing, the GPU sat idle waiting
    for them, charged to nobody: the neighbours got 2-5% of the GPU instead of 25% and 50%."""
    run = forged_run
    assert_daemon_unharmed(run)
    first, second = run.shares(run.start, run.end)
    assert first >= 0.25 * 2 / 3
    assert second >= 0.5 * 2 / 3
    assert second / first == pytest.approx(2.0, rel=0.1)
    # Gates keep opening: a drain answer that never comes holds the GPU for up to the
    # drain timeout (0.5 s), charged to the liar; in any 2 s both ran (500 and 1000 due).
    assert run.fewest(2.0) > 100


def test_forged_slots_cost_the_neighbours_nothing(forged_run: FuzzRun) -> None:
    """What the design promises: a container's lies cost only itself. The time it holds
    the GPU idle is charged to it and stays owed to the others (the switch after it is
    owed to nobody), and its rings, once it is seen waiting, wake nobody.

    Owed, so counted with the repayment: the liar is granted whenever it owes less than
    a quarter quantum, and a turn of its holds the GPU up to a quantum and the drain
    limit, so at any instant it may have taken up to 0.52 s beyond its quarter, which
    its debt then bars it to repay. Over the fuzz alone, the neighbours read up to 4
    and 7 points low where it ended in such a turn (0.212 and 0.427 in a CI run, 3 runs
    in 19 here below the bound). With the REPAID seconds after it they read 0.218 to
    0.242 and 0.444 to 0.482 in 14 runs, four of which the daemon's trace showed
    holding them 0.248 to 0.250 and 0.501 to 0.503 of the time: what they lack is their
    own processes' stalls on this host, as beside an honest neighbour."""
    run = forged_run
    assert held_at_both(run.shares_repaid())


def test_an_answer_ahead_of_the_slice_end_holds_the_gpu_no_longer(
        node: Node, rawlaunch: Path) -> None:
    """Root in a container launches past libcgpu's gate and keeps the gate's protocol
    itself (`attacker ahead`): its slot says it closes itself at the slice's end, and
    at every grant it answers that end at once, as drained, with a ring; at the end it
    stops launching and rings no more. Its slice must still end at the end it was told:
    a dispatcher that took the answer and then slept to the drain limit past the end
    left the GPU idle half a second each turn (charged to the liar), and the neighbour
    waited all of it."""
    node.echo("0/policy", 2)
    node.start_daemon()
    honest = node.container({**cgpu_mem(512), "ALIYUN_COM_GPU_SCHD_WEIGHT": "1"})
    hostile = node.container({**cgpu_mem(512), "ALIYUN_COM_GPU_SCHD_WEIGHT": "1"}, user=0,
                             image=image_with(rawlaunch))
    liar = hostile.proc(env=RAW)
    job = ShareJob(honest, US, 7)
    with sharing([job]) as t0:
        time.sleep(max(0.0, t0 + 1 - time.monotonic()))
        start = time.monotonic()
        answer = fields(liar.ask(f"ahead 5 {US}", timeout=30))
        end = time.monotonic()
    report = job.report(timeout=30)
    assert answer["rc"] == "0", answer
    assert liar.alive()  # it ran in its grants only: nothing for the compute check
    # Turns of about a slice (20 ms) each: 5 s of them is over a hundred grants; turns
    # held to the drain limit would be one grant a second.
    grants = int(answer["answers"])
    print(f"the liar's grants in {end - start:.1f} s: {grants}; its kernels: "
          f"{answer['launches']}")
    assert grants > 50, answer
    # The neighbour runs in nearly every tenth of a second (an audit on a sign may bar it
    # for 0.42 s), and keeps its half.
    windows = window_counts([report], start, end, 0.1, 0.1)
    ran = sum(1 for (kernels,) in windows if kernels > 0) / len(windows)
    share = fraction(report, US, start, end)
    print(f"the neighbour ran in {ran:.0%} of 0.1 s windows; its share {share:.3f}")
    assert ran >= 0.8, windows
    assert held_at(share, 0.5), share
