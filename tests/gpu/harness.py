"""The coordinator of the real-GPU validation: its four sections, tables and checks.

    python3 harness.py memory|compute|overhead|latency

validate.sh starts the control tree and the daemon, then runs each section
under a timeout. Everything comes from the environment it sets:

| variable | meaning |
| --- | --- |
| VALIDATE_MODE | `real` (NVIDIA's driver) or `sim` (simgpu) |
| VALIDATE_BACKEND | `torch` (ResNet50; real's default) or `driver` (synthetic kernels; sim's) |
| VALIDATE_WORK | work folder: sync files, logs, `tables.md`, `checks.txt`, `pids` |
| CGPU_KM_ROOT, CGPU_REGION_DIR | the tree and the regions (cgpu-run and the daemon use them) |
| VALIDATE_WINDOW, VALIDATE_WARMUP | measuring window and warm-up, seconds |
| VALIDATE_BATCHES, VALIDATE_POLICIES | comma lists (default 1,16,32,64,128 and 2,1,5) |
| VALIDATE_OVERHEAD_BATCH | batch of the overhead runs (64) |
| VALIDATE_MEM_LIMIT | memory section's limit, bytes (8 GiB) |
| VALIDATE_CTX_BYTES | bytes cgpu-run charges per context (real mode: 1 GiB, an overestimate) |
| VALIDATE_DAEMON_DIR | has `daemon.pid`, `daemon/snapshot.json`, `daemon-restarts` (a line each) |
| VALIDATE_LATENCY_SECONDS | each latency case's run (3) |
| VALIDATE_LATENCY_ROWS | comma list of the latency rows to run, by name (default: all) |

Exit status: 0 when the section measured (its PASS/FAIL lines are in
checks.txt), 3 when it could not (a worker died, a barrier timed out).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from cgpu_km.tree import client as treefs  # noqa: E402
from tests.bench import latency  # noqa: E402
from tests.bench.shares import measure  # noqa: E402
from tests.daemon.simbox import share_options, stop_job  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
TARGET = 0.03  # the accuracy bar: 3 %
POLICY_NAMES = {0: "fair-share", 1: "preemptive", 2: "weight-based preemptive", 3: "fixed",
                4: "soft", 5: "native"}
WEIGHTS = {"w1": 1, "w2": 2}


class Broken(RuntimeError):
    """The setup failed: the section could not measure."""


def stamp(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


@dataclass(frozen=True)
class Config:
    mode: str
    backend: str
    work: Path
    root: Path
    window: float
    warmup: float
    batches: list[int]
    policies: list[int]
    overhead_batch: int
    mem_limit: int
    ctx_bytes: int | None
    daemon_dir: Path | None
    latency_seconds: float = 3.0
    latency_rows: tuple[str, ...] = ()  # () = every row of make bench's latency table
    python: str = sys.executable

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Config:
        e = dict(os.environ if env is None else env)
        mode = e.get("VALIDATE_MODE", "real")
        if mode not in ("real", "sim"):
            raise Broken(f"VALIDATE_MODE must be real or sim, not {mode!r}")
        backend = e.get("VALIDATE_BACKEND", "torch" if mode == "real" else "driver")
        if backend not in ("torch", "driver"):
            raise Broken(f"VALIDATE_BACKEND must be torch or driver, not {backend!r}")
        ctx = e.get("VALIDATE_CTX_BYTES", str(GiB) if mode == "real" else "")
        return cls(
            mode=mode,
            backend=backend,
            work=Path(e["VALIDATE_WORK"]),
            root=treefs.resolve_root(None),
            window=float(e.get("VALIDATE_WINDOW", "10")),
            warmup=float(e.get("VALIDATE_WARMUP", "3")),
            batches=_ints(e.get("VALIDATE_BATCHES", "1,16,32,64,128")),
            policies=_ints(e.get("VALIDATE_POLICIES", "2,1,5")),
            overhead_batch=int(e.get("VALIDATE_OVERHEAD_BATCH", "64")),
            mem_limit=int(e.get("VALIDATE_MEM_LIMIT", str(8 * GiB))),
            ctx_bytes=int(ctx) if ctx else None,
            daemon_dir=Path(e["VALIDATE_DAEMON_DIR"]) if e.get("VALIDATE_DAEMON_DIR") else None,
            latency_seconds=float(e.get("VALIDATE_LATENCY_SECONDS", "3")),
            latency_rows=tuple(n.strip() for n in e.get("VALIDATE_LATENCY_ROWS", "").split(",")
                               if n.strip()),
        )

    def daemon_restarts(self) -> int:
        """How often the daemon has exited so far (figures taken meanwhile are void)."""
        if self.daemon_dir is None:
            return 0
        try:
            return len((self.daemon_dir / "daemon-restarts").read_text().splitlines())
        except FileNotFoundError:
            return 0

    def daemon_snapshot(self) -> dict[str, Any] | None:
        if self.daemon_dir is None:
            return None
        try:
            data = json.loads((self.daemon_dir / "daemon" / "snapshot.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def reload_daemon(self) -> bool:
        """SIGHUP: the daemon re-reads the tree and reattaches every region."""
        if self.daemon_dir is None:
            return False
        try:
            os.kill(int((self.daemon_dir / "daemon.pid").read_text()), signal.SIGHUP)
        except (OSError, ValueError):
            return False
        return True

    @property
    def worker(self) -> list[str]:
        script = "resnet_worker.py" if self.backend == "torch" else "synthetic_worker.py"
        return [self.python, str(HERE / script)]

    def cgpu_run(self, name: str, *, memsize: int, weight: int = 1) -> list[str]:
        command = [self.python, "-m", "cgpu_km.container.run", "--name", name,
                   "--memsize", str(memsize), "--weight", str(weight)]
        if self.ctx_bytes is not None:
            command += ["--ctx-bytes", str(self.ctx_bytes)]
        return [*command, "--"]


# -- reporting -----------------------------------------------------------------


def emit(cfg: Config, text: str) -> None:
    """Print a table (or any block) and keep it for tables.md."""
    print(text, flush=True)
    with (cfg.work / "tables.md").open("a") as out:
        out.write(text + "\n")


def check(cfg: Config, passed: bool, what: str) -> bool:
    line = f"{'PASS' if passed else 'FAIL'} {what}"
    print(line, flush=True)
    with (cfg.work / "checks.txt").open("a") as out:
        out.write(line + "\n")
    return passed


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in rows)])


def mib(value: float) -> str:
    return f"{value / MiB:.1f} MiB"


# -- processes -------------------------------------------------------------------


@dataclass
class Spawned:
    name: str
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class Processes:
    """Children in their own process groups (cgpu-run and its command die together)."""

    cfg: Config
    children: list[Spawned] = field(default_factory=list)

    def spawn(self, name: str, command: list[str], env: dict[str, str] | None = None) -> Spawned:
        log = self.cfg.work / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            out.write(f"$ {' '.join(command)}\n".encode())
            out.flush()
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        with (self.cfg.work / "pids").open("a") as pids:  # validate.sh's trap kills these
            pids.write(f"{process.pid}\n")
        spawned = Spawned(name, process, log)
        self.children.append(spawned)
        return spawned

    def check_alive(self) -> None:
        for child in self.children:
            rc = child.process.poll()
            if rc is not None:
                tail = child.log.read_text(errors="replace")[-1500:]
                raise Broken(f"{child.name} exited with status {rc}; its log ends:\n{tail}")

    def wait(self, child: Spawned, timeout: float) -> int:
        try:
            return child.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Broken(f"{child.name} did not exit within {timeout:.0f} s") from None

    def stop_all(self) -> None:
        for child in self.children:
            if child.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()
        self.children.clear()


@contextlib.contextmanager
def processes(cfg: Config) -> Iterator[Processes]:
    procs = Processes(cfg)
    try:
        yield procs
    finally:
        procs.stop_all()


def wait_files(procs: Processes, paths: Sequence[Path], timeout: float, what: str,
               failed: Sequence[Path] = ()) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for path in failed:
            if path.exists():
                raise Broken(f"{what}: {path.name}: {path.read_text()[:500]}")
        procs.check_alive()
        if time.monotonic() > deadline:
            missing = [p.name for p in paths if not p.exists()]
            raise Broken(f"{what}: no {', '.join(missing)} within {timeout:.0f} s")
        time.sleep(0.02)


# -- NVML, from outside the containers ------------------------------------------------


class Nvml:
    """Per-process memory and GPU time of GPU 0, as the host sees them."""

    def __init__(self, cfg: Config) -> None:
        import pynvml

        if cfg.mode == "sim":
            from cgpu_km.gpus import load_simgpu

            load_simgpu()
        self.nvml: Any = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def process_memory(self) -> dict[int, int]:
        procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        return {int(p.pid): int(p.usedGpuMemory or 0) for p in procs}

    def busy_since(self, last: int) -> tuple[list[tuple[int, int, int]], int]:
        """(pid, timestamp us, sm percent) samples newer than `last`, and the newest stamp."""
        try:
            samples = self.nvml.nvmlDeviceGetProcessUtilization(self.handle, last)
        except self.nvml.NVMLError:
            return [], last
        rows = [(int(s.pid), int(s.timeStamp), int(s.smUtil)) for s in samples]
        return rows, max([last, *(r[1] for r in rows)])


class Meter:
    """GPU busy seconds per pid over a window, integrated from NVML's process samples.

    NVML samples each process on its own timestamps: a sample covers the time
    since that process's previous sample (not since the newest of anyone's),
    and a process's first sample in the window only sets where it starts."""

    def __init__(self, nvml: Nvml | None) -> None:
        self.nvml = nvml
        self.busy: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.nvml is None:
            return
        self.busy = {}
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self.nvml is not None
        rows, last = self.nvml.busy_since(0)
        since = {pid: when for pid, when, _sm in rows}
        while not self._stop.wait(0.2):
            rows, last = self.nvml.busy_since(last)
            for pid, when, sm in sorted(rows, key=lambda row: row[1]):
                before = since.get(pid)
                if before is not None and when > before:
                    self.busy[pid] = self.busy.get(pid, 0.0) + sm / 100 * (when - before) / 1e6
                since[pid] = max(when, before or 0)

    def stop(self) -> dict[int, float]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        return dict(self.busy)


def open_nvml(cfg: Config) -> Nvml | None:
    try:
        return Nvml(cfg)
    except Exception as error:
        stamp(f"NVML unavailable in the coordinator ({error!r}): no GPU-time column")
        return None


# -- 1. memory -----------------------------------------------------------------


def read_meminfo(cfg: Config, name: str) -> dict[int, int]:
    try:
        text = (cfg.root / "0" / name / "meminfo").read_text()
    except OSError:
        return {}
    return treefs.parse_meminfo(text)[1]


def section_memory(cfg: Config) -> None:
    name = "val-mem"
    status = cfg.work / "memory"
    status.mkdir(exist_ok=True)
    backend = cfg.backend
    limit = cfg.mem_limit
    nvml = open_nvml(cfg)
    with processes(cfg) as procs:
        stamp(f"memory: {backend} process under cgpu-run --memsize {limit} ({mib(limit)})")
        child = procs.spawn("memory", [*cfg.cgpu_run(name, memsize=limit),
                                       cfg.python, str(HERE / "memory_check.py"), backend,
                                       str(status)])
        wait_files(procs, [status / "holding.json"], 180, "memory probe")
        report = json.loads((status / "holding.json").read_text())
        meminfo: dict[int, int] = {}
        from_nvml: dict[int, int] = {}
        deadline = time.monotonic() + 10  # the daemon feeds meminfo every 0.5 s
        while time.monotonic() < deadline:
            meminfo = read_meminfo(cfg, name)
            from_nvml = nvml.process_memory() if nvml is not None else {}
            # The probe runs in a pid namespace of its own: the daemon's meminfo
            # names its host pid (the kernel's attribution), as NVML does.
            if len(meminfo) == 1 and all(from_nvml.get(p) == v for p, v in meminfo.items()):
                break
            time.sleep(0.25)
        report["host_pid"] = next(iter(meminfo), int(report["pid"]))
        (status / "release").touch()
        status_code = procs.wait(child, 60)
    report_memory(cfg, limit, report, meminfo, from_nvml)
    check(cfg, status_code == 0, f"memory: the probe held its memory and exited normally "
          f"(status {status_code}; 137 would be the daemon's backstop SIGKILL)")


def report_memory(cfg: Config, limit: int, report: dict[str, Any], meminfo: dict[int, int],
                  from_nvml: dict[int, int]) -> None:
    pid = int(report["host_pid"])
    seen = report["mem_get_info"]
    inside = report["nvml_inside"]
    smi, smi_holding = report["nvidia_smi_inside"], report["nvidia_smi_holding"]
    allocs = report["alloc"]
    label = "torch.cuda.mem_get_info()" if report["backend"] == "torch" else "cuMemGetInfo"
    rows = [
        [f"{label} total", mib(limit), mib(seen["total"])],
        [f"{label} free at start", "", mib(seen["free"])],
        ["NVML memory total (inside)", mib(limit),
         mib(inside["total"]) if "total" in inside else inside.get("error", "?")],
        ["nvidia-smi memory.total (inside)", f"{limit // MiB} MiB",
         f"{smi['total_mib']} MiB" if "total_mib" in smi else smi.get("error", "?")[:60]],
        [f"allocate free - 64 MiB ({mib(allocs[0]['size'])})", "ok", allocs[0]["result"]],
        ["then allocate 32 MiB", "ok", allocs[1]["result"]],
        ["then allocate 64 MiB (beyond the limit)", "OOM", allocs[2]["result"]],
        [f"{label} free when holding", "< 64 MiB", mib(report["free_after"])],
        ["nvidia-smi memory.used when holding", "",
         f"{smi_holding['used_mib']} MiB" if "used_mib" in smi_holding else "-"],
    ]
    if "torch_reserved" in report:
        rows.append(["torch memory_reserved() when holding", "", mib(report["torch_reserved"])])
    emit(cfg, f"\n### 1. Memory: limit {mib(limit)} on GPU 0 (pid {report['pid']} in its "
              f"container, {pid} on the host)\n")
    emit(cfg, table(["what", "expected", "seen"], rows))
    in_meminfo, in_nvml = meminfo.get(pid), from_nvml.get(pid)
    others = {p: v for p, v in from_nvml.items() if p != pid}
    emit(cfg, "\n" + table(
        ["pid", "daemon meminfo", "NVML per-process", "difference"],
        [[str(pid), mib(in_meminfo) if in_meminfo is not None else "absent",
          mib(in_nvml) if in_nvml is not None else "absent",
          f"{(in_meminfo or 0) - (in_nvml or 0)} B"]]))
    if others:
        emit(cfg, f"(NVML also lists pids {sorted(others)}: other processes on the GPU)")
    check(cfg, seen["total"] == limit, f"memory: {label} total is the limit")
    if "total" in inside:
        check(cfg, inside["total"] == limit, "memory: NVML inside shows the limit")
    if "total_mib" in smi:
        check(cfg, smi["total_mib"] == limit // MiB, "memory: nvidia-smi inside shows the limit")
    check(cfg, [a["result"] for a in allocs] == ["ok", "ok", "OOM"],
          "memory: allocates up to the limit, out of memory beyond it")
    check(cfg, in_meminfo is not None and in_meminfo == in_nvml,
          "memory: daemon meminfo equals NVML's per-process usage")
    if in_nvml is not None:
        check(cfg, in_nvml <= limit, f"memory: NVML's usage of the process ({mib(in_nvml)}) "
              "is within the limit")


# -- 2. compute ------------------------------------------------------------------


@dataclass
class Phase:
    batch: int
    workers: list[str]
    policy: int


Results = list[dict[str, dict[str, Any]]]  # per phase done: worker -> its result


def gpu_times(snapshot: dict[str, Any]) -> dict[str, float]:
    return {c["name"]: float(c.get("gpu_time_seconds", 0.0))
            for c in snapshot.get("containers", []) if c.get("gpu") == 0}


def audit_counts(snapshot: dict[str, Any]) -> dict[str, int]:
    """Audits so far of each container on GPU 0: the compute check's quiet spans."""
    return {c["name"]: int(c.get("audits", 0))
            for c in snapshot.get("containers", []) if c.get("gpu") == 0}


def unaccounted(cfg: Config, names: Sequence[str], timeout: float = 6.0) -> list[str] | None:
    """The containers whose GPU time the daemon did not see grow between two of its
    snapshots while they ran; None when there are no snapshots to tell."""
    first = cfg.daemon_snapshot()
    if first is None:
        return None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.2)
        later = cfg.daemon_snapshot()
        if later is not None and float(later["timestamp"]) >= float(first["timestamp"]) + 1.0:
            before, after = gpu_times(first), gpu_times(later)
            return [n for n in names if after.get(n, 0.0) <= before.get(n, 0.0)]
    return None


def verify_accounting(cfg: Config, names: Sequence[str]) -> None:
    """Running containers must have their GPU time accounted by the daemon, or it
    schedules blind; if not, say so (FAIL) and reload it (SIGHUP) so that the
    figures that follow still mean something."""
    missing = unaccounted(cfg, names)
    if missing is None:
        stamp("cannot tell whether the daemon accounts GPU time (no snapshots)")
        return
    check(cfg, not missing, "daemon: accounts the GPU time of each running container "
          f"({', '.join(names)})" + (f"; not of {', '.join(missing)}" if missing else ""))
    if missing and cfg.reload_daemon():
        stamp(f"GPU time of {', '.join(missing)} not accounted (region not attached?): "
              "sent SIGHUP to cgpu-daemon (reload)")
        still = unaccounted(cfg, missing)
        verdict = f"still not accounted: {', '.join(still)}" if still else "accounted"
        stamp(f"after the reload: {verdict}")


def run_phases(cfg: Config, procs: Processes, sync: Path, plan: list[Phase],
               nvml: Nvml | None, label: str, results: Results,
               containers: dict[str, int | None]) -> None:
    """Drive the workers through the plan; append each phase's results (+ GPU time)."""
    meter = Meter(nvml)
    verified: set[str] = set()
    failed = [sync / f"failed-{w}" for w in {w for p in plan for w in p.workers}]
    for index, phase in enumerate(plan):
        if treefs.read_int(cfg.root / "0" / "policy") != phase.policy:
            treefs.write_node(cfg.root, "0/policy", phase.policy)
        stamp(f"{label} {index + 1}/{len(plan)}: policy {phase.policy}, batch {phase.batch}, "
              f"{'+'.join(phase.workers)}")
        wait_files(procs, [sync / f"ready-{index}-{w}" for w in phase.workers], 300,
                   f"phase {index} ready", failed)
        warm = time.monotonic() + cfg.warmup
        audits_before = audit_counts(cfg.daemon_snapshot() or {})
        fresh = [w for w in phase.workers if containers.get(w) is not None and w not in verified]
        if fresh:
            verify_accounting(cfg, [container_name(w) for w in fresh])
            verified.update(fresh)
        time.sleep(max(0.0, warm - time.monotonic()))
        restarts = cfg.daemon_restarts()
        start = time.time() + 0.2
        (sync / f".go-{index}").write_text(json.dumps({"start": start, "window": cfg.window}))
        os.replace(sync / f".go-{index}", sync / f"go-{index}")
        time.sleep(max(0.0, start - time.time()))
        meter.start()
        before = gpu_times(cfg.daemon_snapshot() or {})
        time.sleep(cfg.window)
        busy = meter.stop()
        after_snapshot = cfg.daemon_snapshot() or {}
        after = gpu_times(after_snapshot)
        audits_after = audit_counts(after_snapshot)
        wait_files(procs, [sync / f"result-{index}-{w}" for w in phase.workers],
                   cfg.window + 120, f"phase {index} results", failed)
        row = {}
        for worker in phase.workers:
            result = json.loads((sync / f"result-{index}-{worker}").read_text())
            name = container_name(worker)
            # NVML's pids are the host's; the worker runs in a pid namespace of its
            # own: the daemon's meminfo says which host pids are that container's.
            pids = set(read_meminfo(cfg, name)) or {int(result["pid"])}
            result["gpu_seconds"] = (sum(busy.get(pid, 0.0) for pid in pids)
                                     if nvml is not None else None)
            result["daemon_seconds"] = (after[name] - before[name]
                                        if name in before and name in after else None)
            result["void"] = cfg.daemon_restarts() != restarts
            # An audit costs a container a quiet span that it takes back within about
            # a second: one in the warm-up or the window moves a short window's ratio.
            result["audits"] = audits_after.get(name, 0) - audits_before.get(name, 0)
            row[worker] = result
        results.append(row)
        (sync / f"done-{index}").touch()
        if nvml is not None and busy and not any(r["gpu_seconds"] for r in row.values()):
            stamp(f"NVML reported GPU time for pids {sorted(busy)}, none of the workers' "
                  f"({[r['pid'] for r in row.values()]}): another PID namespace?")


def start_workers(cfg: Config, procs: Processes, sync: Path, plan: list[Phase],
                  containers: dict[str, int | None]) -> None:
    """One worker per name: in a container of that weight, or bare (None: no libcgpu)."""
    sync.mkdir(parents=True, exist_ok=True)
    (sync / "plan.json").write_text(json.dumps(
        [{"batch": p.batch, "workers": p.workers} for p in plan]))
    memsize = 40 * GiB if cfg.backend == "torch" else 8 * GiB
    for worker, weight in containers.items():
        command = [*cfg.worker, worker, str(sync)]
        env = None
        if weight is not None:
            command = [*cfg.cgpu_run(container_name(worker), memsize=memsize, weight=weight),
                       *command]
        else:  # the same GPU as cgpu-run gives the containers (CUDA's order may differ)
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu0_uuid()}
        procs.spawn(worker, command, env)


def container_name(worker: str) -> str:
    return f"val-{worker}"


def gpu0_uuid() -> str:
    from cgpu_km.gpus import GpuError, discover_gpus

    try:
        return discover_gpus()[0].uuid
    except (GpuError, IndexError):
        return os.environ.get("CUDA_VISIBLE_DEVICES", "0")


def audited(results: dict[str, dict[str, Any]]) -> bool:
    """Whether an audit of a worker fell in the phase (and no restart voided it)."""
    return (not any(r.get("void") for r in results.values())
            and any(r.get("audits") for r in results.values()))


def ratio_row(batch: int, results: dict[str, dict[str, Any]], target: float | None
              ) -> tuple[list[str], float | None]:
    """A table row and the error against the target (None: no target, or void)."""
    slow, fast = results["w1"], results["w2"]
    a, b = float(slow["images_per_s"]), float(fast["images_per_s"])
    ratio = b / a if a > 0 else float("inf")
    error = (ratio / target - 1) if target else None
    def one_to(key: str) -> str:
        time_a, time_b = slow.get(key), fast.get(key)
        return f"1:{time_b / time_a:.2f}" if time_a and time_b else "-"

    shown = f"{error * 100:+.1f}%" if error is not None else "-"
    if slow.get("void") or fast.get("void"):
        error, shown = None, "void: daemon restarted"
    elif audited(results):
        error, shown = None, f"void: audited ({shown})"
    return ([str(batch), f"{a:.1f}", f"{b:.1f}", f"1:{ratio:.3f}",
             f"1:{target:g}" if target else "-", shown, one_to("daemon_seconds"),
             one_to("gpu_seconds")], error)


def describe_workload(cfg: Config, results: list[dict[str, dict[str, Any]]]) -> str:
    if cfg.backend == "driver":
        return f"synthetic sleep_<us> kernels ({cfg.mode})"
    graphs = frozenset(bool(r.get("graph")) for row in results for r in row.values())
    how = {frozenset({True}): "CUDA graphs", frozenset({False}): "eager"}.get(
        graphs, "CUDA graphs where capture worked, else eager (see logs/w*.log)")
    return f"ResNet50 FP16 inference (torchvision, random weights and inputs, {how})"


def section_compute(cfg: Config) -> None:
    sync = cfg.work / "compute"
    plan = [Phase(b, ["w1", "w2"], p) for p in cfg.policies for b in cfg.batches]
    nvml = open_nvml(cfg)
    results: Results = []
    try:
        with processes(cfg) as procs:
            stamp(f"compute: two containers, weights 1:2, {len(plan)} phases of "
                  f"{cfg.warmup:g} s warm-up + {cfg.window:g} s window")
            containers: dict[str, int | None] = dict(WEIGHTS)
            start_workers(cfg, procs, sync, plan, containers)
            run_phases(cfg, procs, sync, plan, nvml, "compute phase", results, containers)
    finally:  # what was measured is shown even when a later phase broke
        report_compute(cfg, plan, results)


def report_compute(cfg: Config, plan: list[Phase], results: Results) -> None:
    if len(results) < len(plan):
        emit(cfg, f"\n(compute: only {len(results)} of {len(plan)} phases measured)")
    workload = describe_workload(cfg, results)
    header = ["batch", "weight 1 img/s", "weight 2 img/s", "ratio", "target", "error",
              "GPU time (daemon)", "GPU time (NVML)"]
    for policy in cfg.policies:
        target = {2: 2.0, 1: 1.0}.get(policy)
        rows = []
        verdicts = []
        void_by_audit = 0
        for phase, result in zip(plan, results, strict=False):
            if phase.policy != policy:
                continue
            row, error = ratio_row(phase.batch, result, target)
            rows.append(row)
            if target is not None and audited(result):
                void_by_audit += 1
            elif target is not None:
                verdicts.append((error is not None and abs(error) <= TARGET,
                                 f"compute: policy {policy}, batch {phase.batch}: ratio "
                                 f"{row[3]}, error {row[5]} (target 1:{target:g} within 3%)"))
        if not rows:
            continue
        name = POLICY_NAMES.get(policy, "?")
        note = {2: "", 1: " (contrast: expect about 1:1)",
                5: " (contrast: native, no time slicing)"}.get(policy, "")
        emit(cfg, f"\n### 2. Compute: policy {policy} ({name}){note}\n{workload}, two "
                  f"containers at weights 1:2, {cfg.window:g} s window\n")
        emit(cfg, table(header, rows))
        for passed, what in verdicts:
            check(cfg, passed, what)
        if void_by_audit:  # not judged: a window an audit fell in (at most one in four)
            check(cfg, 4 * void_by_audit <= len(rows), f"compute: policy {policy}: an audit "
                  f"fell in {void_by_audit} of {len(rows)} windows, which are not judged")


# -- 3. overhead ------------------------------------------------------------------


def section_overhead(cfg: Config) -> None:
    sync = cfg.work / "overhead"
    batch = cfg.overhead_batch
    order = ["bare", "lib", "bare", "lib"]
    plan = [Phase(batch, [w], 1) for w in order]
    results: Results = []
    with processes(cfg) as procs:
        stamp(f"overhead: one process alone at batch {batch}, with and without libcgpu, "
              "alternating")
        containers: dict[str, int | None] = {"lib": 1, "bare": None}
        start_workers(cfg, procs, sync, plan, containers)
        run_phases(cfg, procs, sync, plan, None, "overhead phase", results, containers)
    rates: dict[str, list[float]] = {"bare": [], "lib": []}
    void = False
    for phase, result in zip(plan, results, strict=True):
        worker = phase.workers[0]
        rates[worker].append(float(result[worker]["images_per_s"]))
        void |= bool(result[worker].get("void"))
    bare = sum(rates["bare"]) / len(rates["bare"])
    lib = sum(rates["lib"]) / len(rates["lib"])
    ratio = lib / bare if bare > 0 else 0.0
    emit(cfg, f"\n### 3. Overhead: one process alone, batch {batch}, policy 1, "
              f"{cfg.window:g} s windows\n{describe_workload(cfg, results)}\n")
    emit(cfg, table(["run", "img/s (each window)", "mean img/s"], [
        ["without libcgpu", ", ".join(f"{r:.1f}" for r in rates["bare"]), f"{bare:.1f}"],
        ["with libcgpu (cgpu-run, daemon)", ", ".join(f"{r:.1f}" for r in rates["lib"]),
         f"{lib:.1f}"],
        ["ratio with/without", "", f"{ratio:.4f} ({(ratio - 1) * 100:+.1f}%)"],
    ]))
    check(cfg, ratio >= 1 - TARGET and not void, f"overhead: with/without libcgpu {ratio:.4f} "
          f"(at most 3% slower){' void: the daemon restarted' if void else ''}")


# -- 4. latency ---------------------------------------------------------------------


class TreeHost:
    """`make bench`'s container runner (tests/bench/shares.py's `Host`) on the
    validation's tree and daemon: `cgpu-run` as a module of this interpreter, and
    sharework linked for whichever libcuda.so.1 the host has (NVIDIA's, or
    simgpu's on LD_LIBRARY_PATH when simulated)."""

    sharework = REPO / "simgpu" / "sharework-host"

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.containers: dict[str, subprocess.Popen[bytes]] = {}

    def _log(self, name: str) -> Path:
        return self.cfg.work / "logs" / f"latency-{name}.log"

    def cgpu_run(self, name: str, command: list[str], *, gpu: int = 0,
                 weight: int | None = None, highprio: bool = False,
                 util_limit: int | None = None, stdin: int | IO[bytes] | None = None,
                 stdout: int | IO[bytes] | None = None) -> subprocess.Popen[bytes]:
        # --memsize: sharework holds nothing but its contexts (VALIDATE_CTX_BYTES each)
        args = [self.cfg.python, "-m", "cgpu_km.container.run", "--name", name,
                "--gpu", str(gpu), "--memsize", str(16 * GiB),
                *share_options(weight, highprio, util_limit)]
        if self.cfg.ctx_bytes is not None:
            args += ["--ctx-bytes", str(self.cfg.ctx_bytes)]
        log = self._log(name)
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            process = subprocess.Popen([*args, "--", *command], stdin=stdin,
                                       stdout=stdout if stdout is not None else out,
                                       stderr=out, start_new_session=True)
        with (self.cfg.work / "pids").open("a") as pids:  # validate.sh's trap kills these
            pids.write(f"{process.pid}\n")
        self.containers[name] = process
        return process

    def log(self, name: str) -> str:
        path = self._log(name)
        return path.read_text(errors="replace")[-1500:] if path.exists() else ""

    def stop(self, name: str) -> None:
        process = self.containers.pop(name, None)
        if process is not None:
            stop_job(process)


def section_latency(cfg: Config) -> None:
    """`make bench --only latency`'s rows on this GPU: each row under no scheduler
    (policy 5) and policies 1, 2 and 4, side by side."""
    if not TreeHost.sharework.exists():
        raise Broken(f"{TreeHost.sharework} is not built (make -C simgpu sharework-host)")
    names = [row.name for row in latency.ROWS]
    unknown = [name for name in cfg.latency_rows if name not in names]
    if unknown:
        raise Broken(f"VALIDATE_LATENCY_ROWS: no row {', '.join(map(repr, unknown))}; the rows "
                     f"are {', '.join(map(repr, names))}")
    rows = [row for row in latency.ROWS if not cfg.latency_rows or row.name in cfg.latency_rows]
    host = TreeHost(cfg)
    seconds = cfg.latency_seconds
    stamp(f"latency: {len(rows)} rows x {len(latency.COLUMNS)} schedulers, {seconds:g} s each")
    lines = []
    worst = 0.0
    runs = 0
    try:
        for row in rows:
            got = {}
            for column, policy in latency.COLUMNS:
                treefs.write_node(cfg.root, "0/max_inst", 16)
                treefs.write_node(cfg.root, "0/policy", policy)
                runs += 1
                restarts = cfg.daemon_restarts()
                try:
                    reports = measure(host, row.workloads(), seconds, suffix=f"-{runs}")
                except (RuntimeError, ValueError) as error:
                    raise Broken(f"latency row {row.name!r}, {column}: {error}") from None
                if cfg.daemon_restarts() != restarts:
                    raise Broken(f"the daemon restarted during row {row.name!r}, {column}")
                got[column] = latency.result(row, reports, seconds)
            for column, _policy in latency.COLUMNS:
                text = latency.line(row, column, got[column], got["none"])
                print(text, flush=True)
                lines.append(text)
                if column != "none":
                    worst = max(worst, latency.ratio(got[column].p99, got["none"].p99))
    finally:  # what was measured is shown even when a later row broke
        if lines:
            emit(cfg, f"\n### 4. Latency\n{latency.ABOUT}; {seconds:g} s per case; none = "
                      f"policy 5 (the driver's own time slicing); {latency.LEGEND}\n")
            emit(cfg, "```text\n" + "\n".join([latency.HEAD, "-" * len(latency.HEAD), *lines])
                 + "\n```")
    check(cfg, worst <= latency.P99_TARGET,
          f"latency: worst interactive p99 under policies 1, 2, 4 is {worst:.2f}x no "
          f"scheduler's (target: at most {latency.P99_TARGET:g}x)")


# -- 5. the compute check (issue 36) -----------------------------------------------

JUDGED = "of GPU time in the last"  # the daemon's line for a process it judged


def section_detector(cfg: Config) -> None:
    """What the daemon's compute check makes of this driver's NVML: it stopped
    nothing in the honest runs before it, and it stops a process that launches
    past libcgpu's gate (tests/attacks/rawlaunch.c, ahead of libcgpu in its own
    LD_PRELOAD) beside an honest container at 1:1, policy 1."""
    daemon_log = cfg.work / "logs" / "daemon.log"
    before = daemon_log.read_text(errors="replace") if daemon_log.exists() else ""
    check(cfg, before.count(JUDGED) == 0,
          f"detector: judged {before.count(JUDGED)} processes in the honest sections "
          "(target: 0)")
    library = cfg.work / "librawlaunch.so"
    if not library.exists():
        raise Broken(f"{library} is not built (validate.sh builds tests/attacks/rawlaunch.c)")
    host = TreeHost(cfg)
    treefs.write_node(cfg.root, "0/policy", 1)
    seconds = 8
    work = [str(host.sharework), "--us", "1000", "--seconds", str(seconds)]
    stamp(f"detector: det-a (launches past the gate) beside det-b, policy 1, {seconds} s")
    honest = host.cgpu_run("det-b", work, stdout=subprocess.DEVNULL)
    started = time.monotonic()
    host.cgpu_run("det-a", ["sh", "-c", f'LD_PRELOAD={library}:$LD_PRELOAD exec "$@"',
                            "sh", *work], stdout=subprocess.DEVNULL)
    found_at = None
    while time.monotonic() < started + seconds + 30 and honest.poll() is None:
        text = daemon_log.read_text(errors="replace")[len(before):]
        if found_at is None and "det-a" in text and JUDGED in text:
            found_at = time.monotonic() - started
        time.sleep(0.05)
    host.stop("det-a")
    host.stop("det-b")
    text = daemon_log.read_text(errors="replace")[len(before):]
    lines = [line for line in text.splitlines() if JUDGED in line]
    periods = [line for line in text.splitlines() + before.splitlines()
               if "NVML's per-process samples" in line]
    emit(cfg, "\n### 5. The compute check\nrawlaunch.c in one container, an honest "
              "sharework in the other, policy 1, 1 ms kernels\n")
    emit(cfg, "```text\n" + "\n".join([*periods[-1:], *lines] or ["(nothing judged)"])
         + "\n```")
    print(f"detector: judged {found_at:.1f} s after the start" if found_at is not None
          else "detector: nothing judged", flush=True)
    check(cfg, found_at is not None and all("det-a" in line for line in lines)
          and honest.returncode == 0,
          f"detector: the process that launched past the gate was judged "
          f"({len(lines)} line(s), det-a only), the honest container ran to its end")


SECTIONS = {"memory": section_memory, "compute": section_compute, "overhead": section_overhead,
            "latency": section_latency, "detector": section_detector}


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1 or argv[0] not in SECTIONS:
        print(f"usage: harness.py {'|'.join(SECTIONS)}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))  # `timeout`: clean up the workers
    try:
        cfg = Config.from_env()
        SECTIONS[argv[0]](cfg)
    except Broken as error:
        print(f"BROKEN {argv[0]}: {error}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
