"""Issue 19, items 3 and 4, against the real daemon and runc containers: no GPU time
outside the scheduler, and accounting a container cannot reset.

A process that bypasses libcgpu (the region or the preload moved away) holds a GPU
context the scheduler never gates: the daemon stops it within a memory round, and the
container's other processes keep running. A container that zeroes or fuzzes its account
part still cannot let a new process allocate past its limit once the daemon has seen
what an older process holds.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from cgpu_km.daemon.metrics import SnapshotHolder, make_registry
from cgpu_km.daemon.snapshot import SNAPSHOT_NAME, read_snapshot
from tests.attacks.node import MIB, VENV_BIN, Container, Node, Proc, fields, missing, wait_for
from tests.attacks.test_backstop import STOPPED, cgpu_mem

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing()))]

MOVES = pytest.mark.parametrize("move", [
    "mv /run/cgpu /run/elsewhere",  # libcgpu loads but finds no region
    "mv /etc /etc.image && mkdir /etc",  # the loader finds no ld.so.preload
], ids=["region-moved", "preload-moved"])
# Long enough for a container's start on a busy two-core host; the daemon's round is 0.5 s.
EVENT_TIMEOUT = 30.0


def bypass(container: Container, move: str) -> Proc:
    """Root inside moves a folder above a read-only mount (the folders are the image's own,
    not mount points); a new process then runs without libcgpu, or without its region."""
    assert container.sh(f"{move} && echo moved").strip() == "moved"
    return container.proc(env={"CGPU_REGION": ""})


def stopping_line(container: Container, proc: Proc, verdict: str) -> str:
    return (f"container {container.id12} on GPU 0: pid {proc.host_pid} holds GPU memory "
            f"without libcgpu (not scheduled): {verdict}")


def bypass_figures(node: Node, container: Container) -> tuple[int | None, float | None]:
    """The container's bypass stops in `cgpu-smi --json`, and in the metrics of the same
    snapshot (`cgpu_container_bypass_stops_total`)."""
    out = subprocess.run([str(VENV_BIN / "cgpu-smi"), "--json", "--root", str(node.tree),
                          "--state-dir", str(node.state_dir)], env=node.env,
                         capture_output=True, text=True, timeout=30, check=True).stdout
    rows = [c for c in json.loads(out)["gpus"][0]["containers"] if c["name"] == container.id12]
    snapshot = read_snapshot(node.state_dir / SNAPSHOT_NAME)
    assert snapshot is not None
    gpu = snapshot.gpu(0)
    assert gpu is not None
    metric = make_registry(SnapshotHolder(snapshot)).get_sample_value(
        "cgpu_container_bypass_stops_total",
        {"gpu": "0", "uuid": gpu.uuid, "container": container.id12})
    return (rows[0]["bypass_stops"] if rows else None), metric


@MOVES
def test_a_process_that_bypasses_libcgpu_is_stopped_and_its_neighbours_run_on(
    node: Node, move: str
) -> None:
    """Within its limit (64 MiB of 256), a process without libcgpu makes a context and
    allocates: the daemon SIGKILLs it; the container's own libcgpu process keeps its memory
    and its turns on the GPU. The stop is in the journal, `cgpu-smi` and the metrics."""
    node.start_daemon()
    container = node.container(cgpu_mem(256), user=0)
    keeper = container.proc()
    assert keeper.ask(f"alloc {32 * MIB}") == "alloc rc=0"
    assert keeper.ask("launch 2 1000") == "launch n=2 rc=0"
    rogue = bypass(container, move)
    rogue.send(f"alloc {64 * MIB}")
    assert rogue.wait(EVENT_TIMEOUT) == STOPPED, "the bypassing process was not stopped"
    assert stopping_line(container, rogue, "stopping it") in node.sim.daemon_log()
    assert "over its limit" not in node.sim.daemon_log()  # a bypass stop, not the backstop
    assert rogue.host_pid not in node.nvml_processes()
    assert keeper.alive()
    assert keeper.ask("launch 2 1000") == "launch n=2 rc=0"
    assert keeper.ask(f"alloc {32 * MIB}") == "alloc rc=0"
    assert node.nvml_processes()[keeper.host_pid] == 64 * MIB
    wait_for(lambda: bypass_figures(node, container) == (1, 1.0), EVENT_TIMEOUT,
             "cgpu-smi and the metrics counting the stop")


def test_report_only_for_one_container_stops_the_others(node: Node) -> None:
    """`--report-bypass NAME`: that container's bypassing process is reported and runs on;
    another container's is stopped."""
    reported = node.container(cgpu_mem(256), user=0)
    enforced = node.container(cgpu_mem(256), user=0)
    node.start_daemon("--report-bypass", reported.id12)
    spared, stopped = (bypass(c, "mv /run/cgpu /run/elsewhere") for c in (reported, enforced))
    for proc in (spared, stopped):
        proc.send(f"alloc {64 * MIB}")
    assert stopped.wait(EVENT_TIMEOUT) == STOPPED
    wait_for(lambda: stopping_line(reported, spared, "reported only") in node.sim.daemon_log(),
             EVENT_TIMEOUT, "the report of the spared process")
    assert spared.read_line(EVENT_TIMEOUT) == "alloc rc=0"
    assert spared.ask("launch 1 1000") == "launch n=1 rc=0"
    assert spared.alive()
    assert bypass_figures(node, reported)[0] == 0


def test_under_policy_5_bypassing_stays_a_memory_matter(node: Node) -> None:
    """Policy 5 isolates memory only: a process without libcgpu within the limit is
    counted (meminfo lists it) and left running; past the limit the backstop stops it."""
    node.echo("0/policy", 5)
    node.start_daemon()
    container = node.container(cgpu_mem(256), user=0)
    rogue = bypass(container, "mv /run/cgpu /run/elsewhere")
    assert rogue.ask(f"alloc {64 * MIB}") == "alloc rc=0"
    # The round that feeds meminfo has already decided about the process.
    wait_for(lambda: rogue.host_pid in node.meminfo(container)[1], EVENT_TIMEOUT,
             "meminfo listing the process")
    assert "without libcgpu" not in node.sim.daemon_log()
    assert rogue.ask("launch 1 1000") == "launch n=1 rc=0"
    rogue.send(f"alloc {256 * MIB}")
    assert rogue.wait(EVENT_TIMEOUT) == STOPPED
    assert f"container {container.id12} on GPU 0 holds" in node.sim.daemon_log()


@pytest.mark.parametrize("reset", ["zero", "fuzz 1 19"], ids=["zeroed", "fuzzed"])
def test_a_reset_account_does_not_let_a_new_process_over_the_limit(
    node: Node, reset: str
) -> None:
    """An older process holds 400 MiB of 512; another process of the container zeroes (or
    fuzzes) the account part. Once the daemon has published the older process's memory, a
    new process is refused 200 MiB (which would take the container over its limit and
    have the backstop stop someone), and the older process keeps what it holds.

    Fuzzing also rewrites the older process's slot, which makes it look like a process
    without libcgpu: the container is report-only here, so that it is not stopped for it."""
    container = node.container(cgpu_mem(512))
    node.start_daemon(*(() if reset == "zero" else ("--report-bypass", container.id12)))
    older = container.proc()
    assert older.ask(f"alloc {400 * MIB}") == "alloc rc=0"
    region = container.region()
    wait_for(lambda: [(s.pid, s.bytes) for s in region.seen()] == [(older.pid, 400 * MIB)],
             EVENT_TIMEOUT, "the daemon publishing the older process's memory")
    assert container.run(reset)[0].startswith(reset.split()[0])
    if reset == "zero":
        assert region.usage(0) == 0
    newer = container.proc()
    assert newer.ask(f"alloc {200 * MIB}") == "alloc rc=2"
    if reset == "zero":  # what is left is still there to take
        assert newer.ask(f"alloc {112 * MIB}") == "alloc rc=0"
        assert newer.ask("alloc 1") == "alloc rc=2"
    assert older.alive()
    assert fields(older.ask("info"))["rc"] == "0"
    assert sum(node.nvml_processes().values()) <= 512 * MIB
    assert "over its limit" not in node.sim.daemon_log()
    region.close()
