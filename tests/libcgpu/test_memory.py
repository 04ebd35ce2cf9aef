"""libcgpu's memory limit on simgpu: exact to the byte, every allocation path,
every interception path, racing processes, killed processes, views, eGPU OOM."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cgpu_km.dataplane import region as region_mod
from tests.libcgpu.sandbox import DEVICE_TOTAL, UUID, Sandbox, local_alive, start_time

OOM = 2
NOT_SUPPORTED = 801
MiB = 1 << 20


def rcs(result: subprocess.CompletedProcess[str]) -> list[tuple[str, int]]:
    assert result.returncode == 0, result.stdout + result.stderr
    return Sandbox.rcs(result.stdout)


def test_passthrough_without_region(sandbox: Sandbox) -> None:
    """No CGPU_REGION, or a region file that does not exist: nothing is limited."""
    for env in ({"region": False}, {}):
        result = sandbox.workload("alloc", str(4 << 30), "info", "total", **env)
        assert rcs(result) == [("alloc", 0), ("info", 0), ("total", 0)]
        assert f"total={DEVICE_TOTAL}" in result.stdout
        assert f"total {DEVICE_TOTAL} " in result.stdout
        assert result.stderr == ""


@pytest.mark.parametrize("getproc", [False, True], ids=["exported", "cuGetProcAddress"])
def test_exact_limit(sandbox: Sandbox, getproc: bool) -> None:
    limit = 64 * MiB + 12345
    sandbox.make_region(limit)
    result = sandbox.workload("alloc", str(limit), "alloc", "1", "free", "alloc", "1",
                              "alloc", str(limit - 1), "alloc", "1", "freeall",
                              "alloc", str(limit), getproc=getproc)
    assert rcs(result) == [("alloc", 0), ("alloc", OOM), ("free", 0), ("alloc", 0),
                           ("alloc", 0), ("alloc", OOM), ("freeall", 0), ("alloc", 0)]


def test_exact_limit_through_ctypes_dlsym(sandbox: Sandbox) -> None:
    limit = 8 * MiB + 7
    sandbox.make_region(limit)
    result = sandbox.ctypes_workload("alloc", str(limit - 7), "alloc", "8", "alloc", "7",
                                     "info", "free", "alloc", str(limit))
    assert rcs(result) == [("alloc", 0), ("alloc", OOM), ("alloc", 0), ("info", 0),
                           ("free", 0), ("alloc", OOM)]
    assert f"info free=0 total={limit} " in result.stdout


@pytest.mark.parametrize(("ops", "size"), [
    (["pitch", "1000", "1000"], None),
    (["create", str(2 * MiB)], 2 * MiB),
    (["async", str(3 * MiB)], 3 * MiB),
    (["pool", str(3 * MiB)], 3 * MiB),
    (["array", "1024", "1024"], MiB),
    (["array3d", "256", "256", "16"], MiB),
], ids=["pitch", "cuMemCreate", "async", "pool", "array", "array3d"])
def test_every_allocation_path_counts(sandbox: Sandbox, ops: list[str],
                                      size: int | None) -> None:
    region = sandbox.make_region(16 * MiB)
    proc = sandbox.popen([str(sandbox.built.workload), *ops, "info", "hold"])
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        assert lines[0].endswith("rc=0\n"), lines
        used = region.usage(0)
        if size is None:  # pitched: pitch * height, at least width * height
            pitch = int(lines[0].split("pitch=")[1].split()[0])
            size = pitch * 1000
            assert size >= 1000 * 1000
        assert used == size
        assert f"free={16 * MiB - size} total={16 * MiB}" in lines[1]
    finally:
        proc.communicate(timeout=10)
    assert region.usage(0) == size, "counted until someone sees the process gone"
    assert region.reclaim(local_alive) == [proc.pid]
    assert region.usage(0) == 0


def test_allocation_fails_over_limit_on_every_path(sandbox: Sandbox) -> None:
    sandbox.make_region(MiB)
    result = sandbox.workload("create", str(2 * MiB), "async", str(2 * MiB), "pool",
                              str(2 * MiB), "array", "2048", "1024", "pitch", "2048", "1024")
    assert [rc for _, rc in rcs(result)] == [OOM] * 5


def test_context_memory_counts(sandbox: Sandbox) -> None:
    ctx = 100 * MiB
    sandbox.base_env["SIMGPU_CONTEXT_MEM"] = str(ctx)
    region = sandbox.make_region(ctx + 10 * MiB, ctx_bytes=ctx)
    result = sandbox.workload("alloc", str(10 * MiB), "alloc", "1", "info")
    assert rcs(result) == [("alloc", 0), ("alloc", OOM), ("info", 0)]
    assert f"free=0 total={ctx + 10 * MiB}" in result.stdout
    # a limit smaller than one context: the context itself is refused
    region.set_limit(0, ctx - 1)
    result = sandbox.workload("ctx")
    assert ("ctx", OOM) in Sandbox.rcs(result.stdout)


def test_managed_memory_is_refused(sandbox: Sandbox) -> None:
    sandbox.make_region(64 * MiB)
    result = sandbox.workload("managed", str(MiB))
    assert rcs(result) == [("managed", NOT_SUPPORTED)]
    assert "managed (unified) memory is not supported" in result.stderr


def test_views_show_the_limit(sandbox: Sandbox) -> None:
    limit = 6043 * MiB
    sandbox.make_region(limit)
    result = sandbox.workload("alloc", str(43 * MiB), "info", "total")
    assert f"info free={6000 * MiB} total={limit} rc=0" in result.stdout
    assert f"total {limit} rc=0" in result.stdout


def test_nvml_shows_the_limit(sandbox: Sandbox) -> None:
    """pynvml inside the container (dlsym on libnvidia-ml) sees the limit."""
    limit = 6043 * MiB
    sandbox.make_region(limit)
    script = (
        "import pynvml\n"
        "pynvml.nvmlInit()\n"
        "h = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
        "m = pynvml.nvmlDeviceGetMemoryInfo(h)\n"
        "m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)\n"
        "print(m.total, m.used, m.free, m2.total, m2.used, m2.free)\n"
    )
    result = sandbox.python(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(limit), "0", str(limit)] * 2
    bare = sandbox.python(script, preload=False)
    assert bare.stdout.split()[0] == str(DEVICE_TOTAL)


def _race_round(sandbox: Sandbox, limit: int, processes: int) -> None:
    max_bytes = limit // 3
    procs = [subprocess.Popen(
        [str(sandbox.built.workload), "race", "300", str(max_bytes), str(limit)],
        env=sandbox.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(processes)]
    outputs = [p.communicate(timeout=60) for p in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out + err
        assert out.startswith("race ok="), out


def test_racing_processes_never_exceed_the_limit(sandbox: Sandbox) -> None:
    """8 processes allocate and free at random; simgpu's own per-process
    accounting (NVML, not intercepted) never shows the container over its limit."""
    limit = MiB + 333
    region = sandbox.make_region(limit)
    for _ in range(3):
        _race_round(sandbox, limit, 8)
        region.reclaim(local_alive)  # those the racers did not reclaim themselves
        assert region.processes() == []
        assert region.usage(0) == 0


def test_killed_process_frees_its_share(sandbox: Sandbox) -> None:
    """SIGKILL in the middle of allocating: the share comes back, nobody hangs."""
    limit = 4 * MiB
    region = sandbox.make_region(limit)
    racers = [sandbox.popen([str(sandbox.built.workload), "race", "100000000",
                             str(MiB), str(limit)]) for _ in range(4)]
    # kill them racing: once each has been seen holding some of the share
    holding: set[int] = set()
    deadline = time.monotonic() + 30  # a hang guard only
    while len(holding) < len(racers):
        holding |= {view.pid for view in region.processes() if view.mem[0]}
        assert time.monotonic() < deadline, f"{len(holding)} of the racers allocated"
        time.sleep(0.005)
    for proc in racers:
        proc.send_signal(signal.SIGKILL)
    # once dead (zombies, not waited for yet) they no longer count
    deadline = time.monotonic() + 10
    while any(start_time(p.pid) is not None for p in racers):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    result = sandbox.workload("alloc", str(limit), "info", timeout=10)
    assert rcs(result)[0] == ("alloc", 0)
    for proc in racers:
        proc.communicate(timeout=10)
        assert proc.returncode == -signal.SIGKILL
    region.reclaim(local_alive)
    assert region.processes() == []
    assert region.usage(0) == 0


def test_an_exec_leaves_nothing_counted_behind(sandbox: Sandbox) -> None:
    """The same pid after exec: the old image's memory went with it, and so does
    its slot (same pid, pid namespace and start time)."""
    region = sandbox.make_region(8 * MiB)
    result = sandbox.ctypes_workload("alloc", str(5 * MiB), "exec", "alloc", str(5 * MiB),
                                     "info")
    assert result.stdout.splitlines() == [
        f"alloc {5 * MiB} rc=0", "exec", f"alloc {5 * MiB} rc=0",
        f"info free={3 * MiB} total={8 * MiB} rc=0"], result.stderr
    assert region.usage(0) == 5 * MiB


def test_daemon_reclaims_dead_slots(sandbox: Sandbox) -> None:
    region = sandbox.make_region(4 * MiB)
    proc = sandbox.popen([str(sandbox.built.workload), "alloc", str(MiB), "hold"])
    assert proc.stdout is not None
    assert proc.stdout.readline() == f"alloc {MiB} rc=0\n"
    pid = proc.pid
    assert [p.pid for p in region.processes()] == [pid]
    assert region.reclaim(local_alive) == []
    os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert region.usage(0) == MiB  # nobody noticed yet
    assert region.reclaim(local_alive) == [pid]
    assert region.usage(0) == 0
    proc.communicate()


def test_egpu_oom_runs_script_and_stops(sandbox: Sandbox, tmp_path: Path) -> None:
    report = tmp_path / "oom-report"
    script = tmp_path / "oom.sh"
    script.write_text(f"#!/bin/sh\nenv | grep '^CGPU_OOM_' | sort > {report}\n")
    script.chmod(0o755)
    limit = 32 * MiB
    sandbox.make_region(limit, mode="egpu", oom_script=str(script))
    result = sandbox.workload("alloc", str(30 * MiB), "alloc", str(3 * MiB), "alloc", "1")
    assert result.returncode == -signal.SIGKILL
    assert result.stdout == f"alloc {30 * MiB} rc=0\n"
    assert "out of GPU memory" in result.stderr
    assert "eGPU memory limit exceeded" in result.stderr
    lines = dict(line.split("=", 1) for line in report.read_text().split())
    assert lines == {
        "CGPU_OOM_CONTAINER": "ctr-test", "CGPU_OOM_GPU": "0", "CGPU_OOM_LIMIT": str(limit),
        "CGPU_OOM_USAGE": str(30 * MiB), "CGPU_OOM_REQUEST": str(3 * MiB),
        "CGPU_OOM_PID": lines["CGPU_OOM_PID"],
    }


def test_egpu_oom_script_from_environment(sandbox: Sandbox, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    script = tmp_path / "oom.sh"
    script.write_text(f"#!/bin/sh\necho $CGPU_OOM_REQUEST > {marker}\n")
    script.chmod(0o755)
    sandbox.make_region(MiB, mode="egpu")
    sandbox.base_env["ALIYUN_COM_GPU_OOM_SCRIPT"] = str(script)
    result = sandbox.workload("alloc", str(2 * MiB))
    assert result.returncode == -signal.SIGKILL
    assert marker.read_text() == f"{2 * MiB}\n"


def test_device_not_in_the_container_is_refused(sandbox: Sandbox) -> None:
    sandbox.make_region(MiB, uuid="GPU-00000000-0000-0000-0000-000000000000")
    result = sandbox.workload("ctx")
    assert Sandbox.rcs(result.stdout) == [("ctx", 101)]
    assert "not assigned to the container" in result.stderr


def test_region_by_ordinal_without_uuid(sandbox: Sandbox) -> None:
    sandbox.make_region(MiB, uuid="")
    result = sandbox.workload("alloc", str(MiB), "alloc", "1")
    assert rcs(result) == [("alloc", 0), ("alloc", OOM)]


def test_bad_region_is_reported(sandbox: Sandbox) -> None:
    sandbox.region_path.mkdir()
    (sandbox.region_path / region_mod.CONTROL_NAME).write_bytes(b"\0" * region_mod.CONTROL_SIZE)
    result = sandbox.workload("alloc", str(MiB))
    assert rcs(result) == [("alloc", 0)]
    assert "unknown layout" in result.stderr


def test_each_gpu_has_its_own_limit(sandbox: Sandbox) -> None:
    """Two GPUs matched by UUID, in the opposite order of the driver's ordinals."""
    second = "GPU-6a3f2c10-84b1-4f0e-9d2a-51c7e0b4a9d4"
    sandbox.base_env["SIMGPU_DEVICES"] += f",Tesla T4:15109MiB:{second}"
    region = region_mod.Region.create(
        sandbox.region_path, "two", [region_mod.GpuSpec(2 * MiB, second, 1, 0),
                                     region_mod.GpuSpec(MiB, UUID, 0, 0)], gates_open=True)
    sandbox.region = region
    on_first = sandbox.workload("--device", "0", "alloc", str(MiB), "alloc", "1", "total")
    assert rcs(on_first) == [("alloc", 0), ("alloc", OOM), ("total", 0)]
    assert f"total {MiB} " in on_first.stdout
    on_second = sandbox.workload("--device", "1", "alloc", str(2 * MiB), "alloc", "1", "info")
    assert rcs(on_second) == [("alloc", 0), ("alloc", OOM), ("info", 0)]
    assert f"info free=0 total={2 * MiB} " in on_second.stdout


DLSYM_PROBE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
static const char *owner(void *p) {
    Dl_info info;
    return p && dladdr(p, &info) ? info.dli_fname : "-";
}
int main(void) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    printf("next-malloc-is-libc %d\n",
           dlsym(RTLD_NEXT, "malloc") == dlsym(dlopen("libc.so.6", RTLD_NOW), "malloc"));
    printf("handle %s\n", owner(dlsym(cuda, "cuMemAlloc_v2")));
    printf("handle-unwrapped %s\n", owner(dlsym(cuda, "cuDeviceGetName")));
    return 0;
}
"""


def test_dlsym_interposition(sandbox: Sandbox, tmp_path: Path) -> None:
    """dlsym on a libcuda handle gives the wrapper only with a region; RTLD_NEXT
    still means "after the caller"."""
    source = tmp_path / "probe.c"
    source.write_text(DLSYM_PROBE)
    probe = tmp_path / "probe"
    subprocess.run(["gcc", "-o", str(probe), str(source), "-ldl"], check=True)
    sandbox.make_region(MiB)
    wrapped = subprocess.run([str(probe)], env=sandbox.env(), capture_output=True, text=True,
                             check=True).stdout.splitlines()
    assert wrapped[0] == "next-malloc-is-libc 1"
    assert wrapped[1].endswith("libcgpu.so")
    assert wrapped[2].endswith("libcuda.so.1")
    bare = subprocess.run([str(probe)], env=sandbox.env(CGPU_REGION=""), capture_output=True,
                          text=True, check=True).stdout.splitlines()
    assert bare[0] == "next-malloc-is-libc 1"
    assert bare[1].endswith("libcuda.so.1"), "no region: the real driver's function"


def test_what_the_daemon_saw_bounds_an_allocation_whatever_the_account_says(
        sandbox: Sandbox) -> None:
    """The account part says nothing is held (a container zeroed it), but the control part
    lists a running process of the container holding 40 MiB of a 64 MiB limit: a new process
    gets 24 MiB, not a byte more. A listed process that is gone, or the process itself, is
    not counted twice."""
    region = sandbox.make_region(64 * MiB)
    holder = subprocess.Popen(["sleep", "60"])
    try:
        started = start_time(holder.pid)
        assert started is not None
        pidns = os.stat("/proc/self/ns/pid").st_ino
        held = region_mod.Seen(0, pidns, holder.pid, started, 40 * MiB)
        gone = region_mod.Seen(0, pidns, holder.pid, started + 1, 40 * MiB)  # its pid reused
        region.publish_seen([held, gone])
        assert region.seen_rounds == 1
        assert region.usage(0) == 0
        result = sandbox.workload("alloc", str(24 * MiB + 1), "alloc", str(24 * MiB),
                                  "alloc", "1", "free", "alloc", str(16 * MiB), "info")
        assert rcs(result) == [("alloc", OOM), ("alloc", 0), ("alloc", OOM), ("free", 0),
                               ("alloc", 0), ("info", 0)]
        assert f"info free={8 * MiB} total={64 * MiB} " in result.stdout  # 40 + 16 held
        region.publish_seen([])  # the holder is gone from NVML: the whole limit again
        assert rcs(sandbox.workload("alloc", str(64 * MiB))) == [("alloc", 0)]
        # a publication too old to believe (no daemon any more): the account alone counts
        region.publish_seen([held], now_ns=time.monotonic_ns() - region_mod.SEEN_MAX_AGE_NS - 1)
        assert rcs(sandbox.workload("alloc", str(64 * MiB))) == [("alloc", 0)]
        region.publish_seen([held])
        assert rcs(sandbox.workload("alloc", str(64 * MiB))) == [("alloc", OOM)]
    finally:
        holder.kill()
        holder.wait()


def test_a_process_listed_by_the_daemon_is_not_charged_twice(sandbox: Sandbox) -> None:
    """The process that allocates is in the published list itself (with what it held at
    the last round): its own count replaces that figure, so it reaches its limit exactly."""
    region = sandbox.make_region(32 * MiB)
    proc = sandbox.popen([str(sandbox.built.workload), "alloc", str(16 * MiB), "wait",
                          "alloc", str(16 * MiB), "alloc", "1"])
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().endswith("rc=0\n")
        assert proc.stdout.readline() == "waiting\n"
        started = start_time(proc.pid)
        assert started is not None
        region.publish_seen([region_mod.Seen(0, os.stat("/proc/self/ns/pid").st_ino, proc.pid,
                                             started, 16 * MiB)])
        out, _ = proc.communicate("\n", timeout=30)
        assert Sandbox.rcs(out) == [("alloc", 0), ("alloc", OOM)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
