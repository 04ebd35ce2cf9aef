"""Every route to the driver ends at libcgpu's wrappers (issue 36, item 3).

On simgpu: each call that puts work on the GPU (the launches of CUDA 2, the
multi-device cooperative launch, the sets, the device-side copies, with their
per-thread forms) waits at a closed gate and counts as one launch, whether the
program calls the exported symbol or gets it from cuGetProcAddress; the C
library's dlsym, taken with dlvsym (any version, RTLD_NEXT, through dlvsym
itself, or from a handle of libc), hands out libcgpu's wrappers; a
cuGetProcAddress answer that no exported symbol names is matched by name; and
a library named in LD_PRELOAD before libcgpu that defines cuLaunchKernel is
reported in the process slot (`hijacked`) while its launches still wait.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from cgpu_km.dataplane import region as region_mod
from tests.libcgpu.sandbox import HERE, LIBCGPU, SIMGPU, Built, Sandbox
from tests.libcgpu.test_gate import go, wait_parked, wait_pending

# The calls libcgpu gates beside cuLaunchKernel(Ex), cuLaunchCooperativeKernel and
# cuGraphLaunch (test_gate.py): their exported names.
SETS = [name for bits in (8, 16, 32) for name in (
    f"cuMemsetD{bits}_v2", f"cuMemsetD{bits}_v2_ptds", f"cuMemsetD{bits}Async",
    f"cuMemsetD{bits}Async_ptsz", f"cuMemsetD2D{bits}_v2", f"cuMemsetD2D{bits}_v2_ptds",
    f"cuMemsetD2D{bits}Async", f"cuMemsetD2D{bits}Async_ptsz")]
COPIES = [
    "cuMemcpy", "cuMemcpy_ptds", "cuMemcpyAsync", "cuMemcpyAsync_ptsz",
    "cuMemcpyDtoD_v2", "cuMemcpyDtoD_v2_ptds", "cuMemcpyDtoDAsync_v2",
    "cuMemcpyDtoDAsync_v2_ptsz", "cuMemcpy2D_v2", "cuMemcpy2D_v2_ptds",
    "cuMemcpy2DUnaligned_v2", "cuMemcpy2DUnaligned_v2_ptds", "cuMemcpy2DAsync_v2",
    "cuMemcpy2DAsync_v2_ptsz", "cuMemcpy3D_v2", "cuMemcpy3D_v2_ptds", "cuMemcpy3DAsync_v2",
    "cuMemcpy3DAsync_v2_ptsz", "cuMemcpyPeer", "cuMemcpyPeer_ptds", "cuMemcpyPeerAsync",
    "cuMemcpyPeerAsync_ptsz", "cuMemcpy3DPeer", "cuMemcpy3DPeer_ptds", "cuMemcpy3DPeerAsync",
    "cuMemcpy3DPeerAsync_ptsz",
]
LAUNCHES = ["cuLaunch", "cuLaunchGrid", "cuLaunchGridAsync", "cuLaunchCooperativeKernelMultiDevice"]
GATED = LAUNCHES + COPIES + SETS
# routes.c's other ops: launches test_gate.py covers, and an allocation
OTHERS = ["cuLaunchKernel", "cuLaunchKernel_ptsz", "cuMemAlloc_v2"]

# What a hostile program does to reach the driver past the exported wrappers.
ATTACKS = ["dlsym", "dlvsym", "dlvsym-old", "dlvsym-next", "dlvsym-dlvsym", "libc-dlsym",
           "getproc", "getproc-legacy"]
# One of each kind of gated call, at a closed gate.
HELD = ["cuLaunch", "cuLaunchGrid", "cuLaunchGridAsync", "cuLaunchCooperativeKernelMultiDevice",
        "cuMemsetD8_v2", "cuMemsetD16_v2_ptds", "cuMemsetD2D32Async_ptsz", "cuMemcpy",
        "cuMemcpyDtoDAsync_v2", "cuMemcpy2D_v2_ptds", "cuMemcpy3DAsync_v2", "cuMemcpyPeer",
        "cuMemcpy3DPeerAsync_ptsz"]
# simgpu's cuGetProcAddress hands out entry points no exported symbol names for these
# (SIMGPU_GETPROC_INTERNAL=1), as a real driver may.
INTERNAL = ["cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchGrid", "cuMemsetD8_v2",
            "cuMemcpyDtoDAsync_v2", "cuMemAlloc_v2"]


@dataclass(frozen=True)
class Programs:
    routes: Path
    hijack: Path


@pytest.fixture(scope="session")
def programs(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Programs:
    out = tmp_path_factory.mktemp("routes")
    flags = ["gcc", "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror",
             f"-I{LIBCGPU / 'include'}", f"-I{HERE}"]
    try:
        subprocess.run([*flags, "-o", str(out / "routes"), str(HERE / "routes.c"),
                        str(SIMGPU / "libcuda.so.1"), "-ldl"],
                       check=True, capture_output=True, text=True)
        subprocess.run([*flags, "-shared", "-fPIC", "-o", str(out / "hijack.so"),
                        str(HERE / "hijack.c"), "-ldl"], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as error:
        pytest.fail(f"{' '.join(error.cmd)} failed:\n{error.stdout}{error.stderr}")
    return Programs(out / "routes", out / "hijack.so")


def environment(sandbox: Sandbox, preload: bool, extra: dict[str, str]) -> dict[str, str]:
    env = sandbox.env(preload=preload)
    env.update(extra)
    return env


def run(sandbox: Sandbox, programs: Programs, route: str, *ops: str, preload: bool = True,
        **extra: str) -> subprocess.CompletedProcess[str]:
    args = [str(programs.routes), "--bind", route, *ops]
    return subprocess.run(args, env=environment(sandbox, preload, extra), capture_output=True,
                          text=True, timeout=30)


def start(sandbox: Sandbox, programs: Programs, route: str, op: str,
          **extra: str) -> subprocess.Popen[str]:
    """The program, prepared and waiting for one stdin line before it calls `op`."""
    proc = subprocess.Popen([str(programs.routes), "--bind", route, "wait", op],
                            env=environment(sandbox, True, extra), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == "waiting\n", line + (proc.stderr.read() if proc.stderr else "")
    return proc


def held_then_released(sandbox: Sandbox, proc: subprocess.Popen[str], op: str) -> str:
    """Close the gate, let `op` go: it must wait (pending, asleep in futex) until the
    gate opens, then succeed. Returns its stderr."""
    region = sandbox.region
    assert region is not None
    region.set_gate(0, False)
    go(proc)
    wait_pending(region, 1)
    wait_parked(proc)
    assert proc.poll() is None, f"{op} went through a closed gate"
    region.set_gate(0, True)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, out + err
    assert out.endswith(f"{op} rc=0\n"), out + err
    activity = region.activity(0)
    assert activity.pending == 0
    assert activity.launches == 1, activity
    assert activity.gate_wait_ns > 0
    return err


def test_routes_knows_every_gated_call(sandbox: Sandbox, programs: Programs) -> None:
    listed = subprocess.run([str(programs.routes), "--list"], env=sandbox.env(preload=False),
                            capture_output=True, text=True, check=True).stdout.split()
    assert sorted(listed) == sorted(GATED + OTHERS)


@pytest.mark.parametrize("route", ["exported", *ATTACKS])
def test_every_route_hands_out_libcgpus_wrappers(sandbox: Sandbox, programs: Programs,
                                                 route: str) -> None:
    sandbox.make_region(1 << 30)
    ops = [word for name in GATED + OTHERS for word in ("where", name)]
    result = run(sandbox, programs, route, *ops)
    assert result.returncode == 0, result.stderr
    wheres = result.stdout.splitlines()
    assert wheres == [f"where {name} libcgpu.so {name}" for name in GATED + OTHERS]


def test_without_libcgpu_the_routes_reach_the_driver(sandbox: Sandbox,
                                                     programs: Programs) -> None:
    """The control: the same lookups without libcgpu answer with simgpu's functions."""
    sandbox.make_region(1 << 30)
    for route in ["exported", "dlvsym", "getproc"]:
        result = run(sandbox, programs, route, "where", "cuMemsetD8_v2", "where", "cuLaunch",
                     preload=False)
        assert result.stdout.splitlines() == ["where cuMemsetD8_v2 libcuda.so.1 cuMemsetD8_v2",
                                              "where cuLaunch libcuda.so.1 cuLaunch"], result


def test_dlvsym_still_finds_other_names(sandbox: Sandbox, programs: Programs) -> None:
    sandbox.make_region(1 << 30)
    result = run(sandbox, programs, "exported", "libc")
    assert result.stdout == "libc malloc same\n", result.stderr


@pytest.mark.parametrize("route", ["exported", "getproc"])
@pytest.mark.parametrize("name", GATED)
def test_each_gated_call_counts_one_launch(sandbox: Sandbox, programs: Programs, route: str,
                                           name: str) -> None:
    region = sandbox.make_region(1 << 30)
    result = run(sandbox, programs, route, name)
    assert result.stdout == f"{name} rc=0\n", result.stderr
    assert region.activity(0).launches == 1


@pytest.mark.parametrize("name", HELD)
def test_gated_calls_wait_at_a_closed_gate(sandbox: Sandbox, programs: Programs,
                                           name: str) -> None:
    sandbox.make_region(1 << 30)
    sandbox.start_heartbeat()
    held_then_released(sandbox, start(sandbox, programs, "exported", name), name)


@pytest.mark.parametrize("route", ATTACKS)
def test_a_launch_by_each_lookup_route_waits_at_a_closed_gate(sandbox: Sandbox,
                                                              programs: Programs,
                                                              route: str) -> None:
    sandbox.make_region(1 << 30)
    sandbox.start_heartbeat()
    held_then_released(sandbox, start(sandbox, programs, route, "cuLaunchKernel"),
                       "cuLaunchKernel")


def test_getproc_matches_entry_points_no_symbol_names(sandbox: Sandbox,
                                                      programs: Programs) -> None:
    sandbox.make_region(1 << 30)
    ops = [word for name in INTERNAL for word in ("where", name)]
    driver = run(sandbox, programs, "getproc", *ops, preload=False, SIMGPU_GETPROC_INTERNAL="1")
    # the premise: simgpu's answers are functions that no exported symbol starts at
    assert driver.stdout.splitlines() == [f"where {name} libcuda.so.1 -" for name in INTERNAL]
    for route in ("getproc", "getproc-legacy"):
        wrapped = run(sandbox, programs, route, *ops, SIMGPU_GETPROC_INTERNAL="1")
        assert wrapped.stdout.splitlines() == [f"where {name} libcgpu.so {name}"
                                               for name in INTERNAL], wrapped.stderr


def test_an_internal_entry_point_is_gated_and_counted(sandbox: Sandbox,
                                                      programs: Programs) -> None:
    region = sandbox.make_region(1 << 30)
    sandbox.start_heartbeat()
    held_then_released(sandbox, start(sandbox, programs, "getproc", "cuMemsetD8_v2",
                                      SIMGPU_GETPROC_INTERNAL="1"), "cuMemsetD8_v2")
    # and an allocation by the same route is charged (routes allocates 2 x 4096 first)
    result = run(sandbox, programs, "getproc", "cuMemAlloc_v2", SIMGPU_GETPROC_INTERNAL="1")
    assert result.stdout == "cuMemAlloc_v2 rc=0\n", result.stderr
    assert region.usage(0) == 2 * 4096 + (1 << 20)


def slot_reports(region: region_mod.Region) -> list[int]:
    return [view.hijacked for view in region.processes()]


def test_a_library_ahead_of_libcgpu_is_reported_and_still_gated(sandbox: Sandbox,
                                                                programs: Programs) -> None:
    """hijack.so defines cuLaunchKernel and calls the driver's through the C library's
    dlsym, taken with dlvsym: LD_PRELOAD names it before libcgpu."""
    region = sandbox.make_region(1 << 30)
    sandbox.start_heartbeat()
    preload = f"{programs.hijack}:{sandbox.built.libcgpu}"
    proc = start(sandbox, programs, "exported", "cuLaunchKernel", LD_PRELOAD=preload)
    err = held_then_released(sandbox, proc, "cuLaunchKernel")
    assert slot_reports(region) == [1]
    reports = [line for line in err.splitlines() if "resolve to other code first" in line]
    assert len(reports) == 1, err
    assert f"cuLaunchKernel in {programs.hijack}" in reports[0]


def test_a_process_that_uses_no_gpu_is_reported_too(sandbox: Sandbox,
                                                    programs: Programs) -> None:
    region = sandbox.make_region(1 << 30)
    preload = {"LD_PRELOAD": f"{programs.hijack}:{sandbox.built.libcgpu}"}
    result = subprocess.run(["true"], env=environment(sandbox, True, preload),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert slot_reports(region) == [1]
    assert "cuLaunchKernel in" in result.stderr


def test_nothing_is_reported_when_libcgpu_comes_first(sandbox: Sandbox,
                                                      programs: Programs) -> None:
    """libcgpu ahead of the library (as /etc/ld.so.preload puts it after LD_PRELOAD's
    libraries, this is the order only a host job gets): the wrappers are found first."""
    region = sandbox.make_region(1 << 30)
    result = run(sandbox, programs, "exported", "cuLaunchKernel",
                 LD_PRELOAD=f"{sandbox.built.libcgpu}:{programs.hijack}")
    assert result.stdout == "cuLaunchKernel rc=0\n", result.stderr
    assert "resolve to other code first" not in result.stderr
    assert slot_reports(region) == [0]
    assert region.activity(0).launches == 1
