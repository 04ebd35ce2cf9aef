"""libcgpu against NVIDIA's real driver: run on a machine with an NVIDIA GPU.

    python tests/gpu/libcgpu_torch.py [--limit-mib 4096] [--gpu 0]

Self-contained: builds libcgpu (`make -C libcgpu`) and the C workload if
needed, writes a region file for GPU 0 without any control tree, and checks,
printing one PASS/FAIL/SKIP line each:
  - driver API (C workload, exported symbols and cuGetProcAddress): exact limit
    to the byte, cuMemGetInfo and cuDeviceTotalMem show it, managed memory is
    refused, launches wait at a closed gate and go on when it opens;
  - PyTorch (if importable): torch.cuda.mem_get_info() shows the limit,
    allocating beyond it raises OutOfMemoryError, a kernel launch waits at
    the gate;
  - nvidia-smi with the library preloaded shows the limit as total memory;
  - the launch cost with and without the library (figures, not a check).
Exit status 0 when nothing failed.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from cgpu_km.dataplane import kernelview  # noqa: E402
from cgpu_km.dataplane import region as region_mod  # noqa: E402

MiB = 1 << 20
RESULTS: list[tuple[str, str, str]] = []


def report(status: str, name: str, detail: str = "") -> None:
    RESULTS.append((status, name, detail))
    print(f"{status:<4} {name}{': ' + detail if detail else ''}", flush=True)


def check(name: str, ok: bool, detail: str = "") -> None:
    report("PASS" if ok else "FAIL", name, detail)


def sh(args: list[str], env: dict[str, str] | None = None, timeout: float = 120,
       stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout,
                          input=stdin)


def real_libcuda() -> str | None:
    out = sh(["ldconfig", "-p"]).stdout
    found = [line.split("=>")[-1].strip() for line in out.splitlines()
             if line.strip().startswith("libcuda.so.1 ")]
    if found:
        return found[0]
    for candidate in ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1"):
        if Path(candidate).exists():
            return candidate
    return None


def query_gpu(index: int) -> tuple[str, int]:
    out = sh(["nvidia-smi", "-i", str(index), "--query-gpu=uuid,memory.total",
              "--format=csv,noheader,nounits"]).stdout.strip()
    uuid, total = (part.strip() for part in out.split(","))
    return uuid, int(total) * MiB


def alive(view: region_mod.ProcView) -> bool:
    """Whether a slot's process still runs: the checks' processes share our pid namespace."""
    try:
        state, start = kernelview.parse_stat(Path(f"/proc/{view.pid}/stat").read_text())
    except OSError:
        return False
    return state not in ("Z", "X") and start == view.start_time


class Setup:
    def __init__(self, tmp: Path, limit: int, uuid: str, gpu: int) -> None:
        self.tmp = tmp
        self.limit = limit
        self.library = REPO / "libcgpu" / "libcgpu.so"
        self.region_path = tmp / "gpu-test.region"
        self.region = region_mod.Region.create(
            self.region_path, "gpu-test", [region_mod.GpuSpec(limit, uuid, gpu, 0)],
            gate_timeout_ns=10_000_000_000)
        self.gpu = gpu
        self.beating = threading.Event()

    def env(self, preload: bool = True) -> dict[str, str]:
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        if preload:
            env["LD_PRELOAD"] = str(self.library)
            env["CGPU_REGION"] = str(self.region_path)
        return env

    def fresh(self) -> None:
        """Forget earlier processes' slots (they have exited)."""
        self.region.reclaim(alive)

    def heartbeat_on(self) -> None:
        self.beating.set()

        def beat() -> None:
            while self.beating.is_set():
                self.region.heartbeat()
                time.sleep(0.05)

        threading.Thread(target=beat, daemon=True).start()

    def heartbeat_off(self) -> None:
        self.beating.clear()


def build(tmp: Path, libcuda: str | None) -> Path | None:
    result = sh(["make", "-s", "-C", str(REPO / "libcgpu")])
    check("build libcgpu.so", result.returncode == 0, result.stderr.strip()[-300:])
    if result.returncode != 0 or libcuda is None or shutil.which("gcc") is None:
        report("SKIP", "C workload", "no gcc or no libcuda.so.1")
        return None
    workload = tmp / "workload"
    result = sh(["gcc", "-std=gnu11", "-O2", f"-I{REPO / 'libcgpu' / 'include'}", "-o",
                 str(workload), str(REPO / "tests" / "libcgpu" / "workload.c"), libcuda, "-ldl"])
    check("build C workload", result.returncode == 0, result.stderr.strip()[-300:])
    return workload if result.returncode == 0 else None


def rc_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "rc=" in line]


def driver_checks(setup: Setup, workload: Path) -> None:
    limit = setup.limit
    for flag in ("", "--getproc"):
        setup.fresh()
        label = "cuGetProcAddress" if flag else "exported symbols"
        args = [str(workload), *([flag] if flag else []), "alloc", str(limit), "alloc", "1",
                "free", "alloc", "1", "info", "total", "managed", str(MiB)]
        result = sh(args, env=setup.env())
        lines = rc_lines(result.stdout)
        want = [f"alloc {limit} rc=0", "alloc 1 rc=2", "free rc=0", "alloc 1 rc=0",
                f"info free={limit - 1} total={limit} rc=0", f"total {limit} rc=0",
                "managed rc=801"]
        check(f"driver API ({label}): exact limit, views, managed refused", lines == want,
              "" if lines == want else f"got {lines} {result.stderr.strip()[-300:]}")
    for flag in ("", "--getproc", "--getproc-ptsz"):
        for launch in (["launch", "1", "sleep_0"], ["graph", "1"]):
            setup.fresh()
            prep = ["graphprep"] if launch[0] == "graph" else []
            gate_check(setup, f"gate, {launch[0]} ({flag or 'exported'})",
                       [str(workload), *([flag] if flag else []), *prep, "wait", *launch])


def line_reader(proc: subprocess.Popen[str]) -> Callable[[float], str]:
    """A readline with a timeout ("" when it expires), through a reader thread."""
    lines: queue.Queue[str] = queue.Queue()
    stream = proc.stdout
    assert stream is not None

    def pump() -> None:
        for line in stream:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()

    def read(timeout: float) -> str:
        try:
            return lines.get(timeout=timeout)
        except queue.Empty:
            return ""

    return read


def gate_check(setup: Setup, name: str, args: list[str]) -> None:
    """The command prints "waiting", launches after one stdin line, then exits."""
    proc = subprocess.Popen(args, env=setup.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    read_line = line_reader(proc)
    try:
        line = read_line(120)
        while line and line != "waiting\n":
            line = read_line(120)
        if line != "waiting\n":
            check(name, False, "the workload did not get ready")
            return
        setup.heartbeat_on()
        setup.region.set_gate(0, False)
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(1.0)
        pending = setup.region.activity(0).pending
        blocked = proc.poll() is None and pending >= 1
        setup.region.set_gate(0, True)
        proc.wait(timeout=60)
        out = read_line(5)
        err = proc.stderr.read() if proc.stderr else ""
        ok = blocked and proc.returncode == 0 and "rc=0" in out
        check(name, ok, "" if ok else f"blocked={blocked} pending={pending} rc={proc.returncode}"
              f" {out.strip()[-200:]} {err.strip()[-300:]}")
    finally:
        setup.heartbeat_off()
        setup.region.set_gate(0, True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


TORCH_VIEW = """
import torch
free, total = torch.cuda.mem_get_info(0)
print(free, total)
"""

TORCH_OOM = """
import sys, torch
limit = int(sys.argv[1])
a = torch.empty(int(limit * 0.6), dtype=torch.uint8, device="cuda")
print("first", a.numel(), flush=True)
try:
    b = torch.empty(int(limit * 0.6), dtype=torch.uint8, device="cuda")
    print("second allocated", torch.cuda.memory_reserved())
except torch.cuda.OutOfMemoryError as error:
    print("oom", str(error).splitlines()[0][:160])
"""

TORCH_GATE = """
import sys, torch
x = torch.ones(1024, device="cuda")
torch.cuda.synchronize()
print("waiting", flush=True)
sys.stdin.readline()
y = x * 2
torch.cuda.synchronize()
print("launch rc=0", flush=True)
"""


def torch_checks(setup: Setup) -> None:
    probe = sh([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
               env=setup.env(preload=False))
    if probe.stdout.strip() != "True":
        report("SKIP", "PyTorch checks", "torch with CUDA is not importable here")
        return
    limit = setup.limit
    setup.fresh()
    result = sh([sys.executable, "-c", TORCH_VIEW], env=setup.env())
    fields = result.stdout.split()
    ok = len(fields) == 2 and int(fields[1]) == limit and int(fields[0]) <= limit
    check("torch.cuda.mem_get_info() shows the limit", ok,
          f"(free, total) = {fields} limit={limit}" + ("" if ok else result.stderr[-400:]))
    setup.fresh()
    result = sh([sys.executable, "-c", TORCH_OOM, str(limit)], env=setup.env())
    ok = result.returncode == 0 and "\noom " in result.stdout
    check("torch: allocating beyond the limit raises OutOfMemoryError", ok,
          result.stdout.strip().replace("\n", " | ") + ("" if ok else result.stderr[-400:]))
    setup.fresh()
    gate_check(setup, "torch: a kernel launch waits at the closed gate",
               [sys.executable, "-c", TORCH_GATE])


def smi_check(setup: Setup) -> None:
    if shutil.which("nvidia-smi") is None:
        report("SKIP", "nvidia-smi", "not installed")
        return
    args = ["nvidia-smi", "-i", str(setup.gpu), "--query-gpu=memory.total,memory.used",
            "--format=csv,noheader,nounits"]
    setup.fresh()
    with_lib = sh(args, env=setup.env()).stdout.strip()
    without = sh(args, env=setup.env(preload=False)).stdout.strip()
    total = with_lib.split(",")[0].strip() if with_lib else ""
    ok = total == str(setup.limit // MiB)
    check("nvidia-smi with the library preloaded shows the limit", ok,
          f"with: {with_lib!r} MiB, without: {without!r} MiB")
    table = sh(["nvidia-smi", "-i", str(setup.gpu)], env=setup.env()).stdout
    for line in table.splitlines():
        if "MiB" in line:
            print(f"     nvidia-smi: {line.strip()}")
            break


def bench(setup: Setup, tmp: Path, libcuda: str | None) -> None:
    if libcuda is None or shutil.which("gcc") is None:
        return
    binary = tmp / "bench"
    result = sh(["gcc", "-std=gnu11", "-O2", f"-I{REPO / 'libcgpu' / 'include'}", "-o",
                 str(binary), str(REPO / "tests" / "libcgpu" / "bench.c"), libcuda])
    if result.returncode != 0:
        report("SKIP", "launch cost", result.stderr[-200:])
        return

    def run(preload: bool, args: list[str]) -> float:
        setup.fresh()
        out = sh([str(binary), *args], env=setup.env(preload)).stdout.split()
        return float(out[0]) if out else float("nan")

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    figures: list[tuple[str, Callable[[bool], float]]] = [
        ("launch issue ns, empty kernel", lambda p: run(p, ["launch", "200000", "sleep_0"])),
        ("ns per 50 us kernel (throughput)",
         lambda p: float(sh([str(binary), "launch", "20000", "sleep_50"],
                            env=setup.env(p)).stdout.split()[1])),
        ("cuMemAlloc+cuMemFree ns, 1 MiB", lambda p: run(p, ["alloc", "2000", str(MiB)])),
    ]
    for name, fn in figures:
        without, with_ = [], []
        for _ in range(5):
            without.append(fn(False))
            with_.append(fn(True))
        a, b = median(without), median(with_)
        report("INFO", f"real driver, {name}",
               f"without {a:.1f}, with {b:.1f}, added {b - a:+.1f}, ratio {b / a:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description="libcgpu on a real NVIDIA GPU")
    parser.add_argument("--limit-mib", type=int, default=4096)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--no-bench", action="store_true")
    args = parser.parse_args()
    if shutil.which("nvidia-smi") is None or not Path("/dev/nvidiactl").exists():
        report("SKIP", "all", "no NVIDIA GPU on this machine")
        return 0
    uuid, total = query_gpu(args.gpu)
    limit = args.limit_mib * MiB
    print(f"GPU {args.gpu}: {uuid}, {total // MiB} MiB; limit {args.limit_mib} MiB")
    libcuda = real_libcuda()
    with tempfile.TemporaryDirectory(prefix="libcgpu-gpu-") as name:
        tmp = Path(name)
        workload = build(tmp, libcuda)
        if not (REPO / "libcgpu" / "libcgpu.so").exists():
            return 1
        setup = Setup(tmp, limit, uuid, args.gpu)
        if workload is not None:
            driver_checks(setup, workload)
        torch_checks(setup)
        smi_check(setup)
        if not args.no_bench:
            bench(setup, tmp, libcuda)
    failed = [r for r in RESULTS if r[0] == "FAIL"]
    print(f"SUMMARY: {sum(r[0] == 'PASS' for r in RESULTS)} passed, {len(failed)} failed, "
          f"{sum(r[0] == 'SKIP' for r in RESULTS)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
