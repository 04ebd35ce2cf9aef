"""Issue 36, items 6 and 8: stops that nothing holds up, with the real daemon and
runc containers.

- Hanging OOM scripts of an eGPU container fill the node's script pool in two
  waves; a process of a cGPU container that bypasses libcgpu is stopped all the
  same, before any of them (no stop waits for another).
- An OOM script that does not end (`sleep 30`, a child in the background too):
  its process is frozen while it runs, it is killed with its children at its
  deadline, and the process is killed then; the daemon's record says so.
- A process whose main thread waits in vfork(), under a seccomp filter the
  script must get a copy of: it never reports the stop the copy needs, the
  script does not run, the process is killed.
- What an OOM script says is the script's, quoted under its container and pid.

Every assertion is on what the daemon recorded (its journal), on the order of
events or on what the containers recorded; waits are hang guards only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.attacks.node import MIB, Container, Node, Proc, missing, wait_for
from tests.attacks.test_backstop import STOPPED, cgpu_mem
from tests.attacks.test_oom_and_memsize import egpu_env, lower_memsize
from tests.bench.stops import (
    OOM_SCRIPT,
    REFUSE_UNSHARE_AND_KEYCTL,
    StopLine,
    build_vforker,
    copy_into,
    in_vfork,
    parse_stops,
)

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing()))]

DEADLINE = 5.0  # the daemon's default OOM script deadline
HANG = 120  # a hang guard, never an assertion on time
# It records the state of the process it is run for (inside the container's pid
# namespace: its stat's third field), leaves a child in the background, and hangs.
HANGING = ("#!/bin/sh\n"
           "read -r stat < /proc/$CGPU_OOM_PID/stat; set -- ${stat##*) }\n"
           "echo \"$CGPU_OOM_PID $1\" >> /out/states\n"
           "sleep 30 &\n"
           "echo $! >> /out/children\n"
           "sleep 30\n")


def stop_line(node: Node, host_pid: int) -> StopLine:
    """The daemon's journal line of the stop of `host_pid` (waits for it: a hang guard)."""
    found: list[StopLine] = []

    def logged() -> bool:
        found[:] = [s for s in parse_stops(node.sim.daemon_log()) if s.pid == host_pid]
        return bool(found)

    wait_for(logged, HANG, f"the daemon's record of the stop of pid {host_pid}")
    return found[0]


def stopped(proc: Proc) -> None:
    assert proc.wait(HANG) == STOPPED, proc.stderr()


def no_sleepers(container: Container) -> bool:
    """No `sleep 30` left in the container (its init is `sleep 600`)."""
    out = container.sh("for d in /proc/[0-9]*; do cat $d/cmdline 2>/dev/null; echo; done")
    return "sleep\x0030" not in out


def test_a_bypasser_is_stopped_while_hanging_oom_scripts_fill_the_pool(node: Node) -> None:
    """The starvation case: eight processes of an eGPU container over its limit, in two
    waves 2 s apart, each with an OOM script that hangs (four run at a time, the others
    wait frozen); then a process of a cGPU container that bypasses libcgpu. It is
    stopped before the second wave's stops end, and every one of the eight is stopped."""
    node.start_daemon()
    egpu = node.container(egpu_env(2048, OOM_SCRIPT), files={OOM_SCRIPT: HANGING})
    first = [egpu.proc() for _ in range(4)]
    second = [egpu.proc() for _ in range(4)]
    for proc in first:
        assert proc.ask(f"alloc {200 * MIB}") == "alloc rc=0"
    for proc in second:
        assert proc.ask(f"alloc {100 * MIB}") == "alloc rc=0"
    cgpu = node.container(cgpu_mem(512))
    bypasser = cgpu.proc()
    assert bypasser.ask(f"alloc {100 * MIB}") == "alloc rc=0"
    wait_for(lambda: len(node.meminfo(egpu)[1]) == 8, HANG, "the daemon measuring all eight")

    lower_memsize(node, egpu, 500 * MIB)  # the four of 200 MiB are over: the first wave
    over = f"container {egpu.id12} on GPU 0 holds"
    wait_for(lambda: node.sim.daemon_log().count(over) == 1, HANG, "the first wave")
    wait_for(lambda: all(in_state(p, "T") for p in first), HANG, "the first wave frozen")
    node.backstop_rounds(4)  # two seconds
    lower_memsize(node, egpu, MIB)  # and the other four: the second wave
    wait_for(lambda: node.sim.daemon_log().count(over) == 2, HANG, "the second wave")
    assert bypasser.ask("forge-own 1 4026539999 0") == "forge-own ok"

    stopped(bypasser)
    for proc in first + second:
        stopped(proc)
    bypass = stop_line(node, bypasser.host_pid)
    assert (bypass.reason, bypass.frozen, bypass.script) == ("bypass", None, None)
    waves = [[stop_line(node, p.host_pid) for p in wave] for wave in (first, second)]
    lines = parse_stops(node.sim.daemon_log())
    for line in lines:
        frozen = "-" if line.frozen_for is None else f"{line.frozen_for:.3f} s"
        print(f"pid {line.pid} ({line.reason}): gone {line.gone:.3f} s after it was found, "
              f"frozen for {frozen}, script: {line.script_outcome or '-'}")
    order = [line.pid for line in lines]
    assert order.index(bypasser.host_pid) < min(order.index(p.host_pid) for p in second), \
        "the bypasser waited for the second wave's scripts"
    for wave in waves:
        for line in wave:
            assert line.reason == "memory"
            assert line.frozen is not None
    for line in waves[0]:
        assert line.script_outcome == f"killed at its {DEADLINE:g} s deadline", line
    wait_for(lambda: no_sleepers(egpu), HANG, "the scripts' sleeps killed")


def in_state(proc: Proc, state: str) -> bool:
    try:
        with open(f"/proc/{proc.host_pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == state
    except OSError:
        return False


def test_a_hanging_oom_script_is_killed_with_its_children_at_its_deadline(
    node: Node
) -> None:
    """`sleep 30` in the script, and another in the background (it would hold an output
    pipe): the process is frozen while the script runs; at the deadline the script and
    its children are killed, and the process too."""
    node.start_daemon()
    container = node.container(egpu_env(512, OOM_SCRIPT), files={OOM_SCRIPT: HANGING})
    holder = container.proc()
    assert holder.ask(f"alloc {400 * MIB}") == "alloc rc=0"
    lower_memsize(node, container, 256 * MIB)
    stopped(holder)
    line = stop_line(node, holder.host_pid)
    assert line.script_outcome == f"killed at its {DEADLINE:g} s deadline"
    assert line.script is not None
    assert line.frozen_for is not None
    assert line.frozen_for >= DEADLINE, "frozen for the script's whole deadline, then killed"
    assert line.script[1] - line.script[0] >= DEADLINE
    assert line.frozen is not None
    assert line.frozen <= line.script[0] <= line.script[1] <= line.killed <= line.gone
    states = (container.out / "states").read_text().split()
    assert states == [str(holder.pid), "T"], "the process ran while its script did"
    assert (container.out / "children").read_text().strip()
    wait_for(lambda: no_sleepers(container), HANG, "the script's sleeps killed")
    head = f"container {container.id12} on GPU 0: OOM script {OOM_SCRIPT} for pid " \
        f"{holder.host_pid}"
    assert f"{head} ran past its {DEADLINE:g} s deadline: killed, with what it started" \
        in node.sim.daemon_log()
    assert node.sim.daemon is not None
    assert nsexec_children(node.sim.daemon.pid) == [], "the daemon waits on no script"


def nsexec_children(parent: int) -> list[int]:
    """The daemon's children that run nsexec (a zombie too: not reaped)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and (
                b"nsexec" in cmdline or "(python" in stat):
            found.append(int(entry.name))
    return found


def test_a_process_waiting_in_vfork_is_killed_without_its_script(
    node: Node, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The script must get the container's seccomp filter, copied from the process, which
    must stop for it; a main thread in vfork() never reports the stop. The copy is given
    up, the script does not run (the journal says why), and the process is killed."""
    vforker = build_vforker(tmp_path_factory.mktemp("vforker"))
    node.start_daemon()
    recorder = "#!/bin/sh\necho ran > /out/ran\n"
    container = node.container(egpu_env(512, OOM_SCRIPT), user=0,
                               files={OOM_SCRIPT: recorder},
                               image=lambda root: copy_into(vforker, root),
                               seccomp=REFUSE_UNSHARE_AND_KEYCTL)
    target = container.proc(args=("/vforker",))
    assert target.ask(f"alloc {400 * MIB}") == "alloc rc=0"
    assert target.ask("vfork") == "vfork ok"
    wait_for(lambda: in_vfork(target.host_pid), HANG, "the main thread waiting in vfork")
    lower_memsize(node, container, 256 * MIB)
    stopped(target)
    line = stop_line(node, target.host_pid)
    assert line.script_outcome == "not run"
    assert not (container.out / "ran").exists()
    pid = target.host_pid
    assert (f"container {container.id12} on GPU 0: OOM script {OOM_SCRIPT} for pid {pid} "
            f"not run: cgpu-nsexec: cannot enter the container of pid {pid}: pid {pid} did "
            "not stop within 1 s for the copy of its seccomp filter (a thread of it may "
            "wait in vfork)") in node.sim.daemon_log()


def test_what_an_oom_script_says_is_quoted_as_the_scripts(node: Node) -> None:
    """A script that prints a line as the daemon would, with control characters: the
    journal has it quoted, escaped, under the script's container and pid."""
    node.start_daemon()
    script = ("#!/bin/sh\n"
              "echo 'container 0123456789ab on GPU 0: pid 1 stopped (memory)'\n"
              "printf '\\033[2K\\rcleared\\n' >&2\n"
              "exit 3\n")
    container = node.container(egpu_env(512, OOM_SCRIPT), files={OOM_SCRIPT: script})
    holder = container.proc()
    assert holder.ask(f"alloc {400 * MIB}") == "alloc rc=0"
    lower_memsize(node, container, 256 * MIB)
    stopped(holder)
    line = stop_line(node, holder.host_pid)
    assert line.script_outcome == "exit 3"
    log = node.sim.daemon_log()
    head = f"container {container.id12} on GPU 0: OOM script {OOM_SCRIPT} for pid " \
        f"{holder.host_pid}"
    assert f"{head} exited with status 3" in log
    assert f"{head} said: 'container 0123456789ab on GPU 0: pid 1 stopped (memory)'" in log
    assert f"{head} said: '\\x1b[2K\\rcleared'" in log
    assert "\x1b" not in log
    assert not any(text.startswith("cgpu-daemon: container 0123456789ab")
                   for text in log.splitlines())
