"""Stops: from the daemon's detection to the process gone, by route, many at once.

    python -m tests.bench.stops [--stops N]

The real daemon on simgpu, runc containers (`tests/attacks/node.py`); for each
route N processes (8) of one container are made to be stopped at once, and
each stop's figures are read from the daemon's own journal line (`pid P
stopped (REASON): gone S s after it was found; frozen at +F s, OOM script ...
from +A s to +B s (OUTCOME), SIGKILL at +K s`), counted from the memory round
that found the process:

- bypass: a cGPU container's processes each rewrite their own process slot
  (they look like processes that bypassed libcgpu): SIGKILL at once;
- memory: an eGPU container without an OOM script, its memsize lowered below
  what its processes hold: SIGKILL at once;
- script `true`: the same with an OOM script that ends at once: each process
  frozen, its script run (4 at a time, node-wide), then SIGKILL;
- script `sleep 30`: an OOM script that does not end (a child of it would hold
  an output pipe): killed, with its children, at its deadline (5 s); the
  processes past the first four wait frozen for a turn;
- vfork: the eGPU container runs under a seccomp filter (the OOM script must
  get a copy, for which the process must stop) and each process's main thread
  waits in vfork(), which never reports that stop: the copy is given up after
  1 s, the script does not run, SIGKILL.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.attacks.node import (
    Node,
    bench_site,
    built_node,
    missing,
    wait_for,
)
from tests.daemon.simbox import SIMGPU

REPO = Path(__file__).resolve().parents[2]
VFORKER_C = REPO / "tests" / "attacks" / "vforker.c"
MIB = 1 << 20
STOPPED = re.compile(r"container (?P<container>\S+) on GPU (?P<gpu>\d+): pid (?P<pid>\d+) "
                     r"stopped \((?P<reason>\w+)\): gone (?P<gone>[0-9.]+) s after it was "
                     r"found; (?P<steps>.*)$")
FROZEN = re.compile(r"frozen at \+(?P<at>[0-9.]+) s")
SCRIPT = re.compile(r"OOM script .* from \+(?P<start>[0-9.]+) s to \+(?P<end>[0-9.]+) s "
                    r"\((?P<outcome>[^)]*)\)")
NOT_RUN = re.compile(r"OOM script .* (?P<outcome>not run: [^,]*)")
KILLED = re.compile(r"SIGKILL at \+(?P<at>[0-9.]+) s")
# Docker's default profile refuses both; this one refuses only them (errno 1: EPERM).
REFUSE_UNSHARE_AND_KEYCTL = {
    "defaultAction": "SCMP_ACT_ALLOW",
    "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_AARCH64"],
    "syscalls": [{"names": ["unshare", "keyctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}],
}
OOM_SCRIPT = "/oom.sh"


@dataclass(frozen=True)
class StopLine:
    """One stop as the daemon's journal line says it went (seconds from its detection)."""

    container: str
    pid: int
    reason: str
    gone: float
    killed: float
    frozen: float | None = None
    script: tuple[float, float] | None = None  # from, to
    script_outcome: str = ""

    @property
    def frozen_for(self) -> float | None:
        """From the freeze to the SIGKILL."""
        return None if self.frozen is None else self.killed - self.frozen


def parse_stops(text: str) -> list[StopLine]:
    """Every stop line of a daemon's journal, in order."""
    found = []
    for line in text.splitlines():
        match = STOPPED.search(line)
        if match is None:
            continue
        steps = match["steps"]
        frozen, script, killed = FROZEN.search(steps), SCRIPT.search(steps), \
            KILLED.search(steps)
        not_run = NOT_RUN.search(steps)
        outcome = script["outcome"] if script else (not_run["outcome"] if not_run else "")
        found.append(StopLine(
            match["container"], int(match["pid"]), match["reason"], float(match["gone"]),
            float(killed["at"]) if killed else float("nan"),
            float(frozen["at"]) if frozen else None,
            (float(script["start"]), float(script["end"])) if script else None, outcome))
    return found


def build_vforker(out: Path) -> Path:
    """Compile vforker.c against the driver API's header, linked with simgpu."""
    binary = out / "vforker"
    subprocess.run(["gcc", "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror",
                    f"-I{REPO / 'libcgpu' / 'include'}", "-o", str(binary), str(VFORKER_C),
                    f"-L{SIMGPU}", "-lcuda"], check=True)
    return binary


def in_vfork(host_pid: int) -> bool:
    """Whether the process's main thread waits in vfork() (the kernel's D state)."""
    try:
        stat = Path(f"/proc/{host_pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "D"


def egpu_env(mib: int, script: str = "") -> dict[str, str]:
    """An eGPU container with a limit of `mib` MiB (after the 10 MiB reserve)."""
    env = {"AMP_VGPU_ENABLE": "1", "GPU_MEM_PER_DEVICE": str((mib + 10) * MIB)}
    if script:
        env["ALIYUN_COM_GPU_OOM_SCRIPT"] = script
    return env


@dataclass
class Route:
    name: str
    run: Callable[[Node, int, Path], list[int]]  # (node, count, vforker) -> host pids


def run_route(node: Node, route: Route, count: int, vforker: Path) -> list[StopLine]:
    """The route's stops, as the daemon's journal says they went."""
    pids = set(route.run(node, count, vforker))
    deadline = time.monotonic() + 120  # a hang guard
    while True:
        found = [s for s in parse_stops(node.sim.daemon_log()) if s.pid in pids]
        if len({s.pid for s in found}) == len(pids) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def memory_route(script: str, *, seccomp: bool = False, vfork: bool = False
                 ) -> Callable[[Node, int, Path], list[int]]:
    def run(node: Node, count: int, vforker: Path) -> list[int]:
        files = {OOM_SCRIPT: script} if script else {}
        container = node.container(
            egpu_env(1024, OOM_SCRIPT if script else ""), files=files,
            image=(lambda root: copy_into(vforker, root)) if vfork else None,
            seccomp=REFUSE_UNSHARE_AND_KEYCTL if seccomp else None)
        procs = [container.proc(args=("/vforker",) if vfork else ("/attacker",))
                 for _ in range(count)]
        for proc in procs:
            assert proc.ask(f"alloc {64 * MIB}") == "alloc rc=0"
        if vfork:
            for proc in procs:
                assert proc.ask("vfork") == "vfork ok"
            for proc in procs:
                wait_for(lambda p=proc: in_vfork(p.host_pid), 10,  # type: ignore[misc]
                         "the main thread waiting in vfork")
        node.echo(f"0/{container.id12}/memsize", MIB)  # every process over the limit
        for proc in procs:
            proc.wait(120)
        return [proc.host_pid for proc in procs]
    return run


def copy_into(binary: Path, root: Path) -> None:
    shutil.copy2(binary, root / binary.name)


def bypass_route(node: Node, count: int, vforker: Path) -> list[int]:
    container = node.container({"ALIYUN_COM_GPU_MEM_CONTAINER": "1024",
                                "ALIYUN_COM_GPU_MEM_DEV": "15109"})
    procs = [container.proc() for _ in range(count)]
    for proc in procs:
        assert proc.ask(f"alloc {16 * MIB}") == "alloc rc=0"
    for proc in procs:
        proc.send("forge-own 1 4026539999 0")  # its slot no longer names it
    for proc in procs:
        proc.wait(120)
    return [proc.host_pid for proc in procs]


ROUTES = (
    Route("bypass (cGPU)", bypass_route),
    Route("memory (eGPU, no script)", memory_route("")),
    Route("memory, script `true`", memory_route("#!/bin/sh\ntrue\n")),
    Route("memory, script `sleep 30`", memory_route("#!/bin/sh\nsleep 30\n")),
    Route("memory, script, vfork target", memory_route("#!/bin/sh\ntrue\n", seccomp=True,
                                                       vfork=True)),
)


def spread(values: Sequence[float]) -> str:
    if not values:
        return f"{'-':>7} {'-':>7}"
    return f"{statistics.median(values):>7.3f} {max(values):>7.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stops", type=int, default=8, help="processes stopped at once")
    args = parser.parse_args(argv)
    why = missing()
    if why is not None:
        print(f"stops skipped: {why}\n")
        return 0
    with bench_site("cgpu-bench-stops-") as (folder, rootfs, tree):
        vforker = build_vforker(folder)
        with built_node(tree, rootfs) as node:
            node.start_daemon()
            print(f"Stops: {args.stops} processes of one container stopped at once, by "
                  "route; seconds from the daemon's detection (the memory round that "
                  "found them), from its journal; OOM scripts run 4 at a time, 5 s "
                  "deadline")
            head = (f"{'route':<30} | {'stops':>5} | {'to gone':>7} {'max':>7} | "
                    f"{'frozen':>7} {'max':>7} | script")
            print(head)
            print("-" * len(head))
            for route in ROUTES:
                began = time.monotonic()
                found = run_route(node, route, args.stops, vforker)
                took = time.monotonic() - began
                gone = [s.gone for s in found]
                frozen = [f for s in found if (f := s.frozen_for) is not None]
                outcomes = sorted({s.script_outcome for s in found if s.script_outcome})
                print(f"{route.name:<30} | {len(found):>5} | {spread(gone)} | "
                      f"{spread(frozen)} | {'; '.join(outcomes) or '-'} "
                      f"(the route took {took:.0f} s)", flush=True)
            print("(to gone: detection to the process seen exited; frozen: the freeze "
                  "to the SIGKILL; median and max)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
