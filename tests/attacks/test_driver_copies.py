"""Issue 36, item 2: one process, two copies of the driver, every NVML row counted.

A process in a runc container (its calls through libcgpu, preloaded) copies
libcuda.so.1 to a folder of its own and opens the copy with RTLD_DEEPBIND
(`deepbind.c`): the loader takes it for another object, so the copy has
driver state of its own, and libcgpu sees none of its calls. On simgpu the
copy claims a second process slot with the same pid, and NVML lists the
process twice, as NVIDIA's driver lists a process once per context in some
versions. The daemon must count both rows: it kept the last one, and held a
process with 3 GiB through the copy and 64 MiB through libcgpu at 64 MiB,
against a limit of 1 GiB, with no line in its journal.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cgpu_km.dataplane import region as region_mod
from tests.attacks.node import HERE, MIB, REPO, Node, Proc, fields, missing
from tests.attacks.test_backstop import BACKSTOP_WINDOW, GIB, STOPPED, cgpu_mem
from tests.daemon.simbox import SIMGPU

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing()))]

LIMIT = 1024 * MIB


@pytest.fixture(scope="module")
def deepbind(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`deepbind.c`, linked against libcuda.so.1 as any CUDA program is."""
    binary = tmp_path_factory.mktemp("deepbind") / "deepbind"
    subprocess.run(["gcc", "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-o",
                    str(binary), str(HERE / "deepbind.c"), f"-L{SIMGPU}", "-lcuda", "-ldl"],
                   check=True)
    return binary


def nvml_rows(node: Node) -> list[tuple[int, int]]:
    """simgpu's NVML rows on GPU 0, as listed: (host pid, bytes), one per process slot."""
    script = ("import json, pynvml\nfrom cgpu_km.gpus import load_simgpu\nload_simgpu()\n"
              "pynvml.nvmlInit()\nh = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
              "print(json.dumps([[p.pid, p.usedGpuMemory] for p in "
              "pynvml.nvmlDeviceGetComputeRunningProcesses(h)]))\n")
    out = subprocess.run([sys.executable, "-c", script], env=node.env, capture_output=True,
                         text=True, timeout=30, check=True, cwd=REPO).stdout
    return [(int(pid), int(size)) for pid, size in json.loads(out)]


def two_driver_process(node: Node, deepbind: Path) -> tuple[Proc, str]:
    """A container limited to 1 GiB, and its process with a context through libcgpu (its
    slot claimed) and the copy of libcuda initialized; (the process, the container's name)."""

    def image(root: Path) -> None:
        shutil.copy2(deepbind, root / "deepbind")

    container = node.container(cgpu_mem(1024), image=image)
    node.start_daemon()
    proc = container.proc(args=("/deepbind",))
    # The copy first: its simgpu slot comes before libcgpu's, so NVML lists its row
    # first and libcgpu's last (the one a daemon keeping the last row would see).
    assert proc.ask("init") == "init rc=0"
    with container.region() as region:
        assert [p.pid for p in region.processes()] == [proc.pid], "libcgpu's slot"
    return proc, container.id12


@pytest.mark.parametrize(("deep", "own"), [(3 * GIB, 64 * MIB), (800 * MIB, 300 * MIB)],
                         ids=["3GiB-then-64MiB", "neither-row-over"])
def test_a_process_with_two_copies_of_libcuda_is_counted_whole(
        node: Node, deepbind: Path, deep: int, own: int) -> None:
    """Memory through a copy of libcuda opened with RTLD_DEEPBIND (which libcgpu never
    sees), then a little through libcgpu (within the limit by its own count): NVML lists
    the process twice, the daemon counts both rows, and the backstop stops it, with one
    line in the journal. With 800 MiB and 300 MiB neither row alone is over 1 GiB."""
    proc, name = two_driver_process(node, deepbind)
    assert proc.ask(f"deep-alloc {deep}") == "deep-alloc rc=0"
    rows = [size for pid, size in nvml_rows(node) if pid == proc.host_pid]
    assert rows == [deep, 0], "one row per copy of the driver, the copy's first"
    # libcgpu's own count is what it allocated through libcgpu: this is within the limit
    # (the backstop may already have stopped the process, for the copy's row alone).
    proc.send(f"alloc {own}")
    answer = proc.read_line(BACKSTOP_WINDOW)
    assert answer in (None, "alloc rc=0"), answer
    assert proc.wait(BACKSTOP_WINDOW * 3) == STOPPED, \
        f"the backstop did not stop it: {node.sim.daemon_log()[-2000:]}"
    log = node.sim.daemon_log()
    stops = re.findall(rf"container {name} on GPU 0 holds (\d+) bytes over its limit of "
                       rf"{LIMIT}: stopping pids {proc.host_pid}\n", log)
    assert len(stops) == 1, log
    over = int(stops[0])
    assert over in ((deep + own - LIMIT,) if deep < LIMIT else (deep - LIMIT, deep + own - LIMIT))
    assert proc.host_pid not in dict(nvml_rows(node))
    assert "without libcgpu" not in log, "it had its slot: a memory matter, not a bypass"


def test_simgpu_lists_a_process_once_per_copy_of_its_driver(node: Node, deepbind: Path) -> None:
    """What the daemon reads: two rows with one host pid, each with its copy's memory, and
    the process's one slot in its region."""
    proc, name = two_driver_process(node, deepbind)
    assert proc.ask(f"deep-alloc {100 * MIB}") == "deep-alloc rc=0"
    assert proc.ask(f"alloc {200 * MIB}") == "alloc rc=0"
    assert nvml_rows(node).count((proc.host_pid, 100 * MIB)) == 1
    assert nvml_rows(node).count((proc.host_pid, 200 * MIB)) == 1
    node.backstop_rounds(2)
    container = next(c for c in node.containers if c.id12 == name)
    assert node.meminfo(container) == (724 * MIB, {proc.host_pid: 300 * MIB})
    with region_mod.Region.open(container.region_path) as region:
        assert [p.mem[0] for p in region.processes()] == [200 * MIB], "libcgpu counts its own"
    assert fields(proc.ask("alloc 1"))["rc"] == "0"
    assert proc.alive()
