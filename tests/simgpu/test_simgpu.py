"""simgpu: the simulated driver and NVML, driven through ctypes, pynvml and cuworkload."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.simgpu.simhost import SimHost

MiB = 1 << 20
GiB = 1 << 30
T4_BYTES = 15109 * MiB
V100_BYTES = 16160 * MiB
CONTEXT_MEM = 300 * MiB
V100_UUID = "GPU-00000000-1111-2222-3333-444444444444"

CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_FOUND = 500
NVML_ERROR_INSUFFICIENT_SIZE = 7


def test_devices_come_from_the_environment(sim: SimHost) -> None:
    got = sim.result(
        """
        ok(cu.cuInit(0))
        n = ctypes.c_int(); ok(cu.cuDeviceGetCount(ctypes.byref(n)))
        devs = []
        for i in range(n.value):
            name = ctypes.create_string_buffer(96); ok(cu.cuDeviceGetName(name, 96, i))
            total = ctypes.c_size_t(); ok(cu.cuDeviceTotalMem_v2(ctypes.byref(total), i))
            sms, tpsm = ctypes.c_int(), ctypes.c_int()
            ok(cu.cuDeviceGetAttribute(ctypes.byref(sms), 16, i))
            ok(cu.cuDeviceGetAttribute(ctypes.byref(tpsm), 39, i))
            uuid = ctypes.create_string_buffer(16); ok(cu.cuDeviceGetUuid_v2(uuid, i))
            devs.append([name.value.decode(), total.value, sms.value, tpsm.value, uuid.raw.hex()])
        nv = nvml()
        nvml_devs = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            nvml_devs.append([nv.nvmlDeviceGetName(h), nv.nvmlDeviceGetUUID(h),
                              nv.nvmlDeviceGetMemoryInfo(h).total, nv.nvmlDeviceGetIndex(h)])
        by_uuid = nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByUUID(nvml_devs[1][1]))
        out({"cuda": devs, "nvml": nvml_devs, "by_uuid": by_uuid})
        """
    )
    assert got["cuda"][0][:4] == ["Tesla T4", T4_BYTES, 40, 1024]
    assert got["cuda"][1][:4] == ["Tesla V100-SXM2-16GB", V100_BYTES, 80, 2048]
    assert got["cuda"][1][4] == "00000000111122223333444444444444"
    t4, v100 = got["nvml"]
    assert t4[0] == "Tesla T4"
    assert t4[2] == T4_BYTES
    assert t4[3] == 0
    assert t4[1].startswith("GPU-")
    assert len(t4[1]) == 40
    assert v100 == ["Tesla V100-SXM2-16GB", V100_UUID, V100_BYTES, 1]
    assert got["by_uuid"] == 1


def test_default_device_is_a_t4(sim: SimHost) -> None:
    got = sim.result(
        """
        nv = nvml()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        out([nv.nvmlDeviceGetCount(), nv.nvmlDeviceGetName(h), nv.nvmlDeviceGetMemoryInfo(h).total])
        """,
        SIMGPU_DEVICES="",
    )
    assert got == [1, "Tesla T4", T4_BYTES]


def test_bad_device_list_is_refused_with_one_line(sim: SimHost) -> None:
    proc = sim.run("out(cu.cuInit(0))", SIMGPU_DEVICES="Tesla T4:lots")
    assert proc.stdout.strip() == "1"  # CUDA_ERROR_INVALID_VALUE
    assert proc.stderr.strip() == (
        "simgpu: SIMGPU_DEVICES: device 0: bad memory 'lots' "
        "(use bytes, or a number with KiB/MiB/GiB/TiB)"
    )
    assert not sim.state.exists()


def test_visible_devices_select_and_reorder(sim: SimHost) -> None:
    code = """
        ok(cu.cuInit(0))
        n = ctypes.c_int(); ok(cu.cuDeviceGetCount(ctypes.byref(n)))
        names = []
        for i in range(n.value):
            b = ctypes.create_string_buffer(96); ok(cu.cuDeviceGetName(b, 96, i))
            names.append(b.value.decode())
        out(names)
        """
    assert sim.result(code, CUDA_VISIBLE_DEVICES="1,0") == ["Tesla V100-SXM2-16GB", "Tesla T4"]
    assert sim.result(code, CUDA_VISIBLE_DEVICES="GPU-00000000") == ["Tesla V100-SXM2-16GB"]
    assert sim.result(code, CUDA_VISIBLE_DEVICES="0,7,1") == ["Tesla T4"]


def test_state_file_is_shared_mode_0666(sim: SimHost) -> None:
    old = os.umask(0o077)
    try:
        sim.run("ok(cu.cuInit(0))")
    finally:
        os.umask(old)
    assert stat.S_IMODE(sim.state.stat().st_mode) == 0o666


def test_allocations_beyond_free_memory_fail(sim: SimHost) -> None:
    got = sim.result(
        f"""
        ctx(0)
        p = u64()
        after_ctx = mem_info()
        big = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(after_ctx[0] + 1))
        ok(cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t({GiB})))
        data = (ctypes.c_char * 6).from_buffer_copy(b"simgpu")
        ok(cu.cuMemcpyHtoD_v2(p, data, ctypes.c_size_t(6)))
        back = ctypes.create_string_buffer(6)
        ok(cu.cuMemcpyDtoH_v2(back, p, ctypes.c_size_t(6)))
        after_alloc = mem_info()
        rest = cu.cuMemAlloc_v2(ctypes.byref(u64()), ctypes.c_size_t(after_alloc[0] + 1))
        exact = u64()
        ok(cu.cuMemAlloc_v2(ctypes.byref(exact), ctypes.c_size_t(after_alloc[0])))
        full = mem_info()
        ok(cu.cuMemFree_v2(exact)); ok(cu.cuMemFree_v2(p))
        out({{"after_ctx": after_ctx, "big": big, "after_alloc": after_alloc, "rest": rest,
              "full": full, "freed": mem_info(), "copied": back.raw.decode()}})
        """
    )
    assert got["after_ctx"] == [T4_BYTES - CONTEXT_MEM, T4_BYTES]
    assert got["big"] == CUDA_ERROR_OUT_OF_MEMORY
    assert got["after_alloc"] == [T4_BYTES - CONTEXT_MEM - GiB, T4_BYTES]
    assert got["rest"] == CUDA_ERROR_OUT_OF_MEMORY
    assert got["full"] == [0, T4_BYTES]
    assert got["freed"] == got["after_ctx"]
    assert got["copied"] == "simgpu"


def test_every_allocation_path_is_charged(sim: SimHost) -> None:
    got = sim.result(
        """
        class Loc(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
        class Prop(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("handleTypes", ctypes.c_int), ("loc", Loc),
                        ("win32", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8)]
        class Desc3D(ctypes.Structure):
            _fields_ = [("w", ctypes.c_size_t), ("h", ctypes.c_size_t), ("d", ctypes.c_size_t),
                        ("fmt", ctypes.c_int), ("ch", ctypes.c_uint), ("flags", ctypes.c_uint)]
        ctx(0)
        base = mem_info()[0]
        used = {}
        p = u64()
        ok(cu.cuMemAllocManaged(ctypes.byref(p), ctypes.c_size_t(3 << 20), 1))
        ctypes.memset(p.value, 7, 3 << 20)  # managed memory is host-accessible
        used["managed"] = base - mem_info()[0]
        pitch = ctypes.c_size_t()
        ok(cu.cuMemAllocPitch_v2(ctypes.byref(u64()), ctypes.byref(pitch), ctypes.c_size_t(1000),
                                 ctypes.c_size_t(10), 4))
        used["pitch"] = base - mem_info()[0] - used["managed"]
        used["pitch_value"] = pitch.value
        h = u64()
        prop = Prop(type=1, loc=Loc(1, 0))
        ok(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(4 << 20), ctypes.byref(prop), u64(0)))
        used["create"] = base - mem_info()[0]
        ok(cu.cuMemRelease(h))
        used["released"] = base - mem_info()[0]
        arr = ctypes.c_void_p()
        ok(cu.cuArray3DCreate_v2(ctypes.byref(arr), ctypes.byref(Desc3D(256, 256, 4, 0x20, 4, 0))))
        used["array"] = base - mem_info()[0] - used["released"]
        ok(cu.cuArrayDestroy(arr))
        a = u64()
        ok(cu.cuMemAllocAsync(ctypes.byref(a), ctypes.c_size_t(5 << 20), None))
        used["async"] = base - mem_info()[0] - used["released"]
        ok(cu.cuMemFreeAsync(a, None))
        used["end"] = base - mem_info()[0]
        out(used)
        """
    )
    assert got["managed"] == 3 * MiB
    assert got["pitch_value"] == 1024
    assert got["pitch"] == 1024 * 10
    assert got["create"] == 3 * MiB + 10240 + 4 * MiB
    assert got["released"] == 3 * MiB + 10240
    assert got["array"] == 256 * 256 * 4 * 4 * 4
    assert got["async"] == 5 * MiB
    assert got["end"] == got["released"]


def _raw_processes(sim: SimHost, version: str) -> dict[str, object]:
    """The process list through raw NVML calls, following the size contract."""
    return sim.result(  # type: ignore[no-any-return]
        f"""
        nv = nvml()
        lib = ctypes.CDLL(os.path.join(LIB, "libnvidia-ml.so.1"))
        class V1(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("mem", ctypes.c_ulonglong)]
        class V2(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("mem", ctypes.c_ulonglong),
                        ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]
        fn = getattr(lib, "nvmlDeviceGetComputeRunningProcesses{version}")
        struct = V1 if "{version}" == "" else V2
        h = ctypes.c_void_p()
        ok(lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)))
        count = ctypes.c_uint(0)
        first = fn(h, ctypes.byref(count), None)
        needed = count.value
        count = ctypes.c_uint(needed - 1)
        short = fn(h, ctypes.byref(count), (struct * 8)())
        short_count = count.value
        buf = (struct * 8)()
        count = ctypes.c_uint(8)
        full = fn(h, ctypes.byref(count), buf)
        rows = sorted([b.pid, b.mem] for b in buf[:count.value])
        out({{"first": first, "needed": needed, "short": short, "short_count": short_count,
              "full": full, "rows": rows}})
        """
    )


@pytest.mark.parametrize("version", ["", "_v2", "_v3"])
def test_process_list_across_processes(sim: SimHost, version: str) -> None:
    one = sim.start("--alloc", "1GiB", "--hold-stdin")
    two = sim.start("--alloc", "512MiB", "--primary", "--hold-stdin")
    got = _raw_processes(sim, version)
    assert got["first"] == NVML_ERROR_INSUFFICIENT_SIZE
    assert got["needed"] == 2
    assert got["short"] == NVML_ERROR_INSUFFICIENT_SIZE
    assert got["short_count"] == 2
    assert got["full"] == 0
    assert got["rows"] == sorted([
        [one.ready["pid"], GiB + CONTEXT_MEM],
        [two.ready["pid"], 512 * MiB + CONTEXT_MEM],
    ])


def test_pynvml_sees_memory_of_other_processes(sim: SimHost) -> None:
    work = sim.start("--alloc", "2GiB", "--device", "1", "--hold-stdin")
    got = sim.result(
        """
        nv = nvml()
        rows = []
        for i in range(2):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            m = nv.nvmlDeviceGetMemoryInfo(h)
            m2 = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
            procs = [[p.pid, p.usedGpuMemory] for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
            rows.append([m.total, m.used, m.free, m2.used, procs])
        out(rows)
        """
    )
    used = 2 * GiB + CONTEXT_MEM
    assert got[0] == [T4_BYTES, 0, T4_BYTES, 0, []]
    assert got[1] == [V100_BYTES, used, V100_BYTES - used, used, [[work.ready["pid"], used]]]
    # The workload's own view agrees.
    assert work.ready["free"] == V100_BYTES - used


def test_process_appears_only_with_a_context(sim: SimHost) -> None:
    got = sim.result(
        """
        nv = nvml()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        ok(cu.cuInit(0))
        before = nv.nvmlDeviceGetComputeRunningProcesses(h)
        c = ctx(0)
        during = [[p.pid, p.usedGpuMemory] for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
        ok(cu.cuCtxDestroy_v2(c))
        after = nv.nvmlDeviceGetComputeRunningProcesses(h)
        out({"before": len(before), "during": during, "after": len(after), "pid": os.getpid()})
        """
    )
    assert got["before"] == 0
    assert got["during"] == [[got["pid"], CONTEXT_MEM]]
    assert got["after"] == 0


def test_context_memory_is_configurable(sim: SimHost) -> None:
    got = sim.result("ctx(0); out(mem_info())", SIMGPU_CONTEXT_MEM="64MiB")
    assert got == [T4_BYTES - 64 * MiB, T4_BYTES]


def test_sigkilled_process_memory_is_reclaimed(sim: SimHost) -> None:
    work = sim.start("--alloc", "3GiB", "--hold-stdin")
    code = """
        nv = nvml()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        out([nv.nvmlDeviceGetMemoryInfo(h).used, len(nv.nvmlDeviceGetComputeRunningProcesses(h))])
        """
    assert sim.result(code) == [3 * GiB + CONTEXT_MEM, 1]
    work.process.send_signal(signal.SIGKILL)
    work.process.wait()
    assert sim.result(code) == [0, 0]
    # The freed memory can be allocated again in full.
    assert sim.result(f"ctx(0); p = u64(); out(cu.cuMemAlloc_v2(ctypes.byref(p), "
                      f"ctypes.c_size_t({T4_BYTES - CONTEXT_MEM})))") == 0


def _race(sim: SimHost, n: int, us: int, *extra: str) -> list[float]:
    """Start two workloads, release them together, return their elapsed ms."""
    args = ("--kernels", str(n), "--us", str(us), "--go-stdin", *extra)
    works = [sim.start(*args) for _ in range(2)]
    for work in works:
        work.go()
    elapsed = []
    for work in works:
        line = work.read_line()
        assert line.startswith("done "), line
        elapsed.append(float(line.split("=")[1]))
        work.finish()
    return elapsed


def test_kernels_of_two_processes_serialize(sim: SimHost) -> None:
    n, us = 20, 10_000
    elapsed = _race(sim, n, us)
    print(f"elapsed {elapsed} ms for {2 * n * us / 1000:g} ms of kernels")
    # One engine: the later finisher waited for all 2N kernels.
    assert max(elapsed) >= 2 * n * us / 1000 * 0.97
    # In time slices, so the earlier one too, but for its head start.
    assert min(elapsed) >= 2 * n * us / 1000 * 0.9


def test_streams_and_graphs_use_the_same_engine(sim: SimHost) -> None:
    elapsed = _race(sim, 10, 10_000, "--graph")
    assert max(elapsed) >= 200 * 0.97


def test_other_devices_run_in_parallel(sim: SimHost) -> None:
    """Kernels queued on both devices at once each take their own time on their
    device's engine (events time the engine); one engine for both would take two."""
    got = sim.result(
        """
        contexts = [ctx(0), ctx(1)]
        fns, streams = [], []
        for c in contexts:
            ok(cu.cuCtxSetCurrent(c))
            fns.append(kernel(1000))
            s = ctypes.c_void_p(); ok(cu.cuStreamCreate(ctypes.byref(s), 1)); streams.append(s)
        starts = []
        for c, s in zip(contexts, streams):
            ok(cu.cuCtxSetCurrent(c)); starts.append(record(s))
        ends = [[], []]
        for _ in range(300):
            for dev in (0, 1):
                ok(cu.cuCtxSetCurrent(contexts[dev]))
                launch(fns[dev], streams[dev])
                ends[dev].append(record(streams[dev]))
        # both still had work queued when the last launch was made
        both_busy = [cu.cuEventQuery(e[-1]) == 600 for e in ends]
        per_kernel = []
        for dev in (0, 1):
            ok(cu.cuCtxSetCurrent(contexts[dev])); ok(cu.cuStreamSynchronize(streams[dev]))
            done = [elapsed_ms(starts[dev], e) for e in ends[dev]]
            per_kernel.append((done[250] - done[50]) / 200)
        out({"both_busy": both_busy, "per_kernel": per_kernel})
        """
    )
    assert got["both_busy"] == [True, True], got
    assert all(abs(ms - 1) < 0.001 for ms in got["per_kernel"]), got


def test_exact_process_utilization_follows_busy_time(sim: SimHost) -> None:
    busy = sim.start("--kernels", "40", "--us", "10000", "--go-stdin", "--hold-stdin")
    idle = sim.start("--hold-stdin")
    t0_us = time.time_ns() // 1000
    busy.go()
    assert busy.read_line().startswith("done ")
    time.sleep(0.2)
    got = sim.result(
        f"""
        nv = nvml()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        samples = nv.nvmlDeviceGetProcessUtilization(h, {t0_us})
        window_ms = (time.time_ns() // 1000 - {t0_us}) / 1000
        out({{"samples": {{str(s.pid): s.smUtil for s in samples}}, "window_ms": window_ms,
              "other": len(nv.nvmlDeviceGetProcessUtilization(
                  nv.nvmlDeviceGetHandleByIndex(0), 0))}})
        """,
        SIMGPU_NVML_EXACT="1",
    )
    expected = 100 * 400 / got["window_ms"]
    samples = got["samples"]
    assert set(samples) == {str(busy.ready["pid"]), str(idle.ready["pid"])}
    assert abs(samples[str(busy.ready["pid"])] - expected) <= 6
    assert samples[str(idle.ready["pid"])] == 0


def test_utilization_rates_of_a_saturated_device(sim: SimHost) -> None:
    work = sim.start("--kernels", "300", "--us", "10000", "--go-stdin")
    work.go()
    time.sleep(1.1)
    got = sim.result(
        """
        nv = nvml()
        u = [nv.nvmlDeviceGetUtilizationRates(nv.nvmlDeviceGetHandleByIndex(i)).gpu for i in (0, 1)]
        out(u)
        """
    )
    assert got[0] >= 95
    assert got[1] == 0


def test_get_proc_address_resolves_versions_and_ptsz(sim: SimHost) -> None:
    got = sim.result(
        """
        ok(cu.cuInit(0))
        def proc(name, version, flags=0):
            fn, status = ctypes.c_void_p(), ctypes.c_int(-1)
            rc = cu.cuGetProcAddress_v2(name.encode(), ctypes.byref(fn), version, u64(flags),
                                        ctypes.byref(status))
            return [rc, status.value, fn.value or 0]
        def addr(sym):
            return ctypes.cast(getattr(cu, sym), ctypes.c_void_p).value
        out({
            "alloc": proc("cuMemAlloc", 12000)[2] == addr("cuMemAlloc_v2"),
            "ctx": proc("cuCtxCreate", 11000)[2] == addr("cuCtxCreate_v2"),
            "ctx3": proc("cuCtxCreate", 12000)[2] == addr("cuCtxCreate_v3"),
            "launch": proc("cuLaunchKernel", 12000)[2] == addr("cuLaunchKernel"),
            "ptsz": proc("cuLaunchKernel", 12000, 2)[2] == addr("cuLaunchKernel_ptsz"),
            "graph": proc("cuGraphLaunch", 12000, 2)[2] == addr("cuGraphLaunch_ptsz"),
            "gpa": proc("cuGetProcAddress", 12000)[2] == addr("cuGetProcAddress_v2"),
            "missing": proc("cuNoSuchThing", 12000),
            "too_old": proc("cuMemAllocAsync", 11000)[:2],
        })
        """
    )
    assert got.pop("missing") == [CUDA_ERROR_NOT_FOUND, 1, 0]
    assert got.pop("too_old") == [CUDA_ERROR_NOT_FOUND, 2]
    assert all(got.values()), got


def test_error_strings(sim: SimHost) -> None:
    got = sim.result(
        """
        s = ctypes.c_char_p()
        ok(cu.cuGetErrorName(2, ctypes.byref(s))); name = s.value.decode()
        ok(cu.cuGetErrorString(2, ctypes.byref(s))); text = s.value.decode()
        unknown = cu.cuGetErrorName(12345, ctypes.byref(s))
        nv = nvml()
        out([name, text, unknown, nv.nvmlErrorString(7), nv.nvmlErrorString(3)])
        """
    )
    assert got == ["CUDA_ERROR_OUT_OF_MEMORY", "out of memory", 1, "Insufficient Size",
                   "Not Supported"]


def test_events_time_the_engine(sim: SimHost) -> None:
    got = sim.result(
        """
        ctx(0)
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        ok(cu.cuModuleLoadData(ctypes.byref(mod), b"anything"))
        ok(cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"sleep_25000"))
        a, b = ctypes.c_void_p(), ctypes.c_void_p()
        ok(cu.cuEventCreate(ctypes.byref(a), 0)); ok(cu.cuEventCreate(ctypes.byref(b), 0))
        t0 = time.monotonic()
        ok(cu.cuEventRecord(a, None))
        for _ in range(4):
            ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, None, None, None))
        ok(cu.cuEventRecord(b, None))
        host_ms = (time.monotonic() - t0) * 1000
        not_ready = cu.cuEventQuery(b)
        ok(cu.cuEventSynchronize(b))
        ms = ctypes.c_float()
        ok(cu.cuEventElapsedTime(ctypes.byref(ms), a, b))
        out([host_ms, not_ready, ms.value])
        """
    )
    host_ms, not_ready, ms = got
    print(f"the launches took {host_ms:.2f} ms of the host's time")
    assert not_ready == 600  # CUDA_ERROR_NOT_READY: the launches returned first
    # 100 ms of kernels (not the host's 0.05 ms of launches), plus at most what the
    # host took between the two records and the engine's own wake-ups at each
    # kernel's end (tens of us each on a loaded host); a fifth kernel would be 25 ms
    assert 99 <= ms <= 100 + host_ms + 5, got


def test_tight_launch_loop_is_bounded_by_the_queue(sim: SimHost) -> None:
    got = sim.result(
        """
        ctx(0)
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        ok(cu.cuModuleLoadData(ctypes.byref(mod), b"x"))
        ok(cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"sleep_20000"))
        t0 = time.monotonic()
        for _ in range(10):
            ok(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, None, None))
        launched = time.monotonic() - t0
        ok(cu.cuCtxSynchronize())
        out([launched, time.monotonic() - t0])
        """,
        SIMGPU_QUEUE_DEPTH="4",
    )
    launched, total = got
    # The 5th launch waits for the 1st kernel, ..., the 10th for the 6th.
    assert launched >= 0.115
    assert total >= 0.195
    assert launched < total


def test_state_keeps_its_devices_while_in_use(sim: SimHost) -> None:
    sim.start("--hold-stdin")
    proc = sim.run(
        "nv = nvml(); out(nv.nvmlDeviceGetCount())", SIMGPU_DEVICES="A100-SXM4-40GB:40GiB"
    )
    assert proc.stdout.strip() == "2"
    assert "is in use with SIMGPU_DEVICES=" in proc.stderr
    sim.stop_all()
    got = sim.result(
        """
        nv = nvml(); h = nv.nvmlDeviceGetHandleByIndex(0)
        out([nv.nvmlDeviceGetCount(), nv.nvmlDeviceGetName(h), nv.nvmlDeviceGetMemoryInfo(h).total])
        """,
        SIMGPU_DEVICES="A100-SXM4-40GB:40GiB",
    )
    assert got == [1, "A100-SXM4-40GB", 40 * GiB]


def test_engine_settings_come_from_the_state(sim: SimHost) -> None:
    proc = sim.run("ok(cu.cuInit(0))", SIMGPU_SCHED="roundrobin")
    assert proc.stderr.strip() == (
        "simgpu: SIMGPU_SCHED=roundrobin is neither fifo nor timeslice; using timeslice"
    )
    sim.start("--hold-stdin", SIMGPU_TIMESLICE_US="5000")
    proc = sim.run("ok(cu.cuInit(0))", SIMGPU_SCHED="fifo")
    assert proc.stderr.count("\n") == 1
    assert "SIMGPU_SCHED=timeslice SIMGPU_TIMESLICE_US=5000 SIMGPU_CTX_SWITCH_US=25;" in proc.stderr
    # Not given: whatever the state holds, silently.
    assert sim.run("ok(cu.cuInit(0))").stderr == ""


def _unshare_pid() -> list[str]:
    """A command prefix that runs in a new PID namespace, or skip."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for PID namespaces")
    wrap = ["unshare", "--pid", "--fork", "--mount-proc"]
    if subprocess.run([*wrap, "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("unshare --pid does not work here")
    return wrap


def _child_pids(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children]


def test_pids_are_seen_from_the_readers_namespace(sim: SimHost) -> None:
    wrap = _unshare_pid()
    boxed = sim.start("--alloc", "1GiB", "--hold-stdin", wrap=wrap)
    host = sim.start("--alloc", "2GiB", "--hold-stdin")
    assert boxed.ready["pid"] == 1  # its own view, inside the namespace
    (boxed_host_pid,) = _child_pids(boxed.process.pid)
    code = """
        nv = nvml(); h = nv.nvmlDeviceGetHandleByIndex(0)
        out(sorted([p.pid, p.usedGpuMemory] for p in nv.nvmlDeviceGetComputeRunningProcesses(h)))
        """
    # From the host, the kernel translates both to host PIDs.
    assert sim.result(code) == sorted([
        [boxed_host_pid, GiB + CONTEXT_MEM],
        [host.ready["pid"], 2 * GiB + CONTEXT_MEM],
    ])
    # From another namespace, neither is visible: the PIDs they recorded
    # (the outermost their /proc shows: 1 for the boxed one, the host PID
    # for the host one).
    assert sim.result(code, wrap=wrap) == sorted([
        [1, GiB + CONTEXT_MEM],
        [host.ready["pid"], 2 * GiB + CONTEXT_MEM],
    ])


def test_simgpu_pid_overrides_the_recorded_pid(sim: SimHost) -> None:
    wrap = _unshare_pid()
    sim.start("--hold-stdin", wrap=wrap, SIMGPU_PID="4242")
    code = """
        nv = nvml(); h = nv.nvmlDeviceGetHandleByIndex(0)
        out([p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)])
        """
    assert sim.result(code, wrap=wrap) == [4242]


def test_get_proc_address_knows_every_export(sim: SimHost) -> None:
    if shutil.which("nm") is None:
        pytest.skip("needs nm (binutils) to list the exports")
    listing = subprocess.run(
        ["nm", "-D", "--defined-only", str(sim.lib_dir / "libcuda.so.1")],
        capture_output=True, text=True, check=True,
    ).stdout
    exports = sorted(line.split()[-1] for line in listing.splitlines() if " T " in line)
    assert "cuMemAlloc_v2" in exports
    assert "cuLaunchKernel_ptsz" in exports
    # Every exported function is what some (name, version, flags) query returns,
    # asking by the export's own name or by its base name, as runtimes do.
    got = sim.result(
        f"""
        import re
        ok(cu.cuInit(0))
        seen = set()
        for name in {exports!r}:
            base = re.sub(r"(_v[0-9]+)?(_ptsz|_ptds)?$", "", name)
            for query in (name, base):
                for version in (2000, 3020, 4000, 9020, 10000, 11000, 11040, 12000, 12080):
                    for flags in (0, 2):
                        fn = ctypes.c_void_p()
                        if cu.cuGetProcAddress_v2(query.encode(), ctypes.byref(fn), version,
                                                  u64(flags), None) == 0:
                            seen.add(fn.value)
        out([n for n in {exports!r}
             if ctypes.cast(getattr(cu, n), ctypes.c_void_p).value not in seen])
        """
    )
    assert got == []
