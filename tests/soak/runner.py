"""The soak's edges: a simulated node that runs a plan and records what happened.

One node: simgpu with `gpus` T4s, the mounted FUSE tree, the real
`cgpu-daemon`, runc containers with `cgpu-hook` (`tests.attacks.node`), and
a Docker engine of its own whose runtime is `cgpu-container-runtime`
(`cgpu_km.demo.dockerd`). `Soak.run(plan)` executes the plan's events at
their times (churn containers in a pool of threads), samples the daemon and
the node every second, and returns a `Record`: the raw material of
`tests.soak.figures`. Nothing here judges anything.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from cgpu_km.container.oci.settings import CONFIG_ENV, Settings, render_settings
from cgpu_km.container.oci.spec import HookCall, SimGpu
from cgpu_km.daemon.snapshot import read_snapshot
from cgpu_km.dataplane import region as region_mod
from cgpu_km.demo.dockerd import PrivateDocker
from cgpu_km.demo.image import build_rootfs, rootfs_tar
from cgpu_km.tree import client as treefs
from tests.attacks.node import (
    RAW,
    Container,
    Node,
    ShareJob,
    build_attacker,
    build_rawlaunch,
    make_rootfs,
)
from tests.bench.shares import Report
from tests.conftest import MountedTree
from tests.daemon.simbox import SHAREWORK, SIMGPU, SimHost
from tests.soak import plan as soak_plan
from tests.soak.plan import INITIAL_POLICY, Event, Fault, Pair, Start, Write

IMAGE = "cgpu-soak:latest"
MIB = 1 << 20
# The pairs' kernels. With 2 ms kernels, sixteen workload processes wake 8000 times a
# second beside the churn on two cores; the soak's CPU load then showed in the
# shares (one GPU's 1:3 and 4:3 held 6 to 7.5% off for minutes, the same in two runs,
# while the daemon woke 0.15 ms late on average), which 5 ms kernels do not.
PAIR_US = 5000
PERIOD = 0.1  # the daemon's default
VENV_BIN = Path(sys.executable).parent
CUWORKLOAD = SIMGPU / "cuworkload"
OOM_SCRIPT = "/oom.sh"


@dataclass
class Probe:
    """A churn container's life: its limit as the probe found it, its kernels."""

    number: int
    engine: str
    gpu: int
    id12: str
    expected: int
    started: float | None = None  # seconds from the soak's start; None: refused
    stopped: float | None = None
    total: int | None = None  # cuMemGetInfo's total inside
    over_refused: bool | None = None  # the allocation of limit + 1 byte failed
    kernels: int = 0
    error: str = ""


@dataclass
class FaultRecord:
    kind: str
    at: float  # seconds from the soak's start: its container starts, or the fault itself
    gpu: int
    trigger: float | None = None  # the kill, the write: what recovery is counted from
    done: float | None = None  # the fault's own end (restarted, stopped)
    lost: list[str] = field(default_factory=list)  # regions not stamped after a restart
    note: str = ""


@dataclass
class Sample:
    at: float
    daemon_pid: int
    rss_kib: int
    fds: int
    log_bytes: int
    registered: int
    regions: int
    # each GPU's dispatcher so far (the snapshot's): wake-ups at a deadline, seconds late
    late: dict[int, tuple[int, float]] = field(default_factory=dict)


@dataclass
class PairRun:
    """One epoch's pair on one GPU: what each workload completed."""

    gpu: int
    at: float
    until: float
    first: Report | None = None
    second: Report | None = None
    registered: list[tuple[float, bool]] = field(default_factory=list)


@dataclass
class Record:
    """What one soak run did and saw."""

    seconds: float
    gpus: int
    t0: float  # CLOCK_MONOTONIC of the soak's start
    probes: list[Probe] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    writes: list[tuple[Write, str]] = field(default_factory=list)  # (write, "" or its error)
    samples: list[Sample] = field(default_factory=list)
    pairs: list[PairRun] = field(default_factory=list)
    leftovers: dict[str, list[str]] = field(default_factory=dict)
    hook_errors: list[str] = field(default_factory=list)  # cgpu-hook's, at runc's stops
    daemon_log: str = ""
    applied: list[Event] = field(default_factory=list)  # the pairs and writes that took


Made = tuple[int, Container, Container]  # a GPU and its pair's containers


class SoakNode(Node):
    """`tests.attacks.node.Node` on `gpus` GPUs, with its own claim folder; a
    container's `NVIDIA_VISIBLE_DEVICES` picks its GPU (simgpu shows it that one)."""

    def __init__(self, base: Path, tree: Path, rootfs: Path, gpus: int) -> None:
        super().__init__(base, tree, rootfs)
        self.claims = base / "claims"
        self.hook_errors: list[str] = []  # what cgpu-hook said when runc stopped one
        self.sim = SimHost(base, tree, gpus=gpus, env={
            "SIMGPU_CONTEXT_MEM": "0", "CGPU_LIBCGPU": str(self.library),
            "CGPU_DAEMON_LOG_LEVELS": "1"})
        Path(self.env["SIMGPU_STATE"]).unlink(missing_ok=True)
        self.nvml_processes()  # the state file again, with every GPU

    def hook_env(self) -> list[str]:
        return [*super().hook_env(), f"CGPU_HOOK_STATE_DIR={self.claims}"]

    def _config(self, bundle: Path, env: Mapping[str, str], user: int) -> dict[str, object]:
        config = super()._config(bundle, env, user)
        process = config["process"]
        assert isinstance(process, dict)
        gpu = env.get("NVIDIA_VISIBLE_DEVICES", "0")
        process["env"] = [e for e in process["env"] if e != "NVIDIA_VISIBLE_DEVICES=0"]
        process["env"] += [f"SIMGPU_VISIBLE_DEVICES={gpu}"]
        return config

    def remove(self, container: Container, keep_rootfs: bool = False) -> None:
        """Kill its processes, `runc delete --force` (poststop runs), delete its bundle
        (but a root filesystem it shares with others)."""
        for proc in container.procs:
            with contextlib.suppress(Exception):
                proc.close()
        deleted = subprocess.run(["runc", "delete", "--force", container.id],
                                 capture_output=True, text=True, errors="replace", timeout=60,
                                 check=False)
        # runc runs poststop and tells what a failing hook printed
        self.hook_errors += [f"{container.id12}: {line[line.index('cgpu-hook:'):][:300]}"
                             for line in deleted.stderr.splitlines() if "cgpu-hook:" in line]
        with contextlib.suppress(ValueError):
            self.containers.remove(container)
        if keep_rootfs:
            shutil.rmtree(container.bundle / "out", ignore_errors=True)
        else:
            shutil.rmtree(container.bundle, ignore_errors=True)


def last_error(text: str) -> str:
    """The line of an engine's error output that says why: the hook's own, else the last."""
    lines = text.strip().splitlines() or ["?"]
    hook = [line for line in lines if "cgpu-hook:" in line]
    return (hook[-1][hook[-1].index("cgpu-hook:"):] if hook else lines[-1])[:300]


def fields_of(text: str, key: str) -> list[str]:
    return re.findall(rf"\b{key}=(\S+)", text)


def probe_script(limit: int, prefix: str = "") -> str:
    """The probe: cuMemGetInfo's total (`cuworkload` alone), then one allocation of the
    limit and a byte, which must fail (cGPU: CUDA_ERROR_OUT_OF_MEMORY; eGPU: the process
    is stopped), and its exit status."""
    return (f"{prefix}cuworkload; {prefix}cuworkload --alloc {limit + 1}; echo over=$?; "
            "echo probed")


def read_probe(text: str, probe: Probe) -> None:
    """The probe's answers: the total, and whether the allocation over the limit failed."""
    text = text[:text.find("probed")] if "probed" in text else text
    totals = fields_of(text, "total")
    status = fields_of(text, "over")
    probe.total = int(totals[0]) if totals else None
    probe.over_refused = None if not status else (
        status[0] != "0" and f"alloc {probe.expected + 1} ok" not in text)


def kernels_done(text: str) -> int:
    """The kernels cuworkload completed, by its last `kernels=` report."""
    counted = fields_of(text, "kernels")
    return int(counted[-1]) if counted else 0


def pidns_processes(pidns: int, init: int) -> list[int]:
    """Host pids of the processes of pid namespace `pidns` but its init."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != init:
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}/ns/pid").st_ino == pidns:
                    found.append(int(entry))
    return found


class Soak:
    """A node that runs a soak plan (use as a context manager)."""

    def __init__(self, gpus: int, out: Path) -> None:
        self.gpus = gpus
        self.out = out
        self.folder = Path(tempfile.mkdtemp(prefix="cgpu-soak-"))
        self.folder.chmod(0o755)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.live: dict[int, list[tuple[str, Probe]]] = {g: [] for g in range(gpus)}
        self.docker: PrivateDocker | None = None
        self.tree: MountedTree | None = None
        self.node: SoakNode | None = None
        self.ids: set[str] = set()  # every container id the soak started (cgroup names)
        self.pair_of: dict[int, tuple[str, str]] = {}  # GPU -> the running pair's id12s

    # -- the node --

    def __enter__(self) -> Soak:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        rootfs = self.folder / "rootfs"
        self.rawlaunch = build_rawlaunch(self.folder)
        make_rootfs(rootfs, [build_attacker(self.folder), SHAREWORK, CUWORKLOAD,
                             self.rawlaunch])
        self.tree_root = self.folder / "tree" / "cgpu_km"
        self.tree = MountedTree(self.tree_root, self.gpus)
        (self.folder / "node").mkdir(mode=0o755)
        self.node = SoakNode(self.folder / "node", self.tree_root, rootfs, self.gpus)
        self.setup_tree()
        # The pairs' root filesystem: an idle container's, which lives as long as the soak.
        # Not managed (no cGPU variables): the hook leaves it alone.
        self.base_container = self.node.container({})
        image = self.folder / "image"
        build_rootfs(image)
        (self.folder / "image.tar").write_bytes(rootfs_tar(image))
        config = self.folder / "runtime.toml"
        sim = self.node.sim
        settings = Settings(
            runtimes=("runc",),
            hook=HookCall(path=str(VENV_BIN / "cgpu-hook"), root=str(self.tree_root),
                          env=(f"PATH={os.environ.get('PATH', '/usr/bin:/bin')}",
                               f"CGPU_REGION_DIR={sim.region_dir}",
                               f"CGPU_HOOK_STATE_DIR={self.node.claims}",
                               f"CGPU_LIBCGPU={self.node.library}",
                               "SIMGPU_CONTEXT_MEM=0")),
            simulate="on", simgpu=SimGpu(SIMGPU, Path(sim.env["SIMGPU_STATE"])),
            simgpu_devices=sim.env["SIMGPU_DEVICES"])
        config.write_text(render_settings(settings))
        docker_folder = self.folder / "docker"
        docker_folder.mkdir()
        self.docker = PrivateDocker(
            docker_folder, {"runtimes": {"cgpu": {"path": str(VENV_BIN /
                                                              "cgpu-container-runtime")}}},
            env={CONFIG_ENV: str(config)})
        self.docker.start()
        self.docker.check("import", str(self.folder / "image.tar"), IMAGE)
        sim.start_daemon(PERIOD)

    def setup_tree(self) -> None:
        for gpu in range(self.gpus):
            self.echo(gpu, "policy", INITIAL_POLICY)

    def echo(self, gpu: int, node: str, value: int) -> None:
        assert self.node is not None
        self.node.sim.echo(f"{gpu}/{node}", value)

    def close(self) -> None:
        if self.docker is not None:
            with contextlib.suppress(Exception):
                self.docker.stop()
        if self.node is not None:
            with contextlib.suppress(Exception):
                self.node.close()
        if self.tree is not None:
            with contextlib.suppress(Exception):
                self.tree.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- the run --

    def now(self, record: Record) -> float:
        return time.monotonic() - record.t0

    def run(self, events: Sequence[Event], seconds: float) -> Record:
        assert self.node is not None
        first = events[0] if events and isinstance(events[0], Pair) else None
        ready = None
        if first is not None:  # its workloads start with the soak's clock
            ready = self.make_pair(first, lambda: first.until - 0.5 - 3)
        record = Record(seconds, self.gpus, time.monotonic())
        sampler = threading.Thread(target=self.sample, args=(record,), daemon=True)
        sampler.start()
        pool = ThreadPoolExecutor(max_workers=6)
        pending: list[Future[None]] = []
        threads: list[threading.Thread] = []
        try:
            for event in events:
                delay = record.t0 + event.at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                if isinstance(event, Pair):
                    pending.append(pool.submit(self.pair, record, event,
                                               ready if event is first else None))
                elif isinstance(event, Start):
                    pending.append(pool.submit(self.churn, record, event))
                elif isinstance(event, Write):
                    self.write(record, event)
                elif isinstance(event, Fault):  # not in the pool: a fault is never late
                    thread = threading.Thread(target=self.fault, args=(record, event),
                                              daemon=True)
                    thread.start()
                    threads.append(thread)
            time.sleep(max(0.0, record.t0 + seconds - time.monotonic()))
        except BaseException:  # interrupted: what is under way ends as close() stops it
            self.stopping.set()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        for future in pending:
            with contextlib.suppress(Exception):
                future.result(timeout=180)
        pool.shutdown(wait=True)
        for thread in threads:
            thread.join(timeout=180)
        self.stopping.set()
        sampler.join(timeout=10)
        self.node.remove(self.base_container)
        self.settle(record)
        record.leftovers = self.leftovers()
        record.hook_errors = list(self.node.hook_errors)
        record.daemon_log = self.node.sim.daemon_log()
        return record

    def sample(self, record: Record) -> None:
        assert self.node is not None
        sim = self.node.sim
        while not self.stopping.wait(1.0):
            daemon = sim.daemon
            pid = daemon.pid if daemon is not None and daemon.poll() is None else 0
            rss = fds = 0
            if pid:
                with contextlib.suppress(OSError):
                    status = Path(f"/proc/{pid}/status").read_text()
                    found = re.search(r"VmRSS:\s+(\d+)", status)
                    rss = int(found[1]) if found else 0
                    fds = len(os.listdir(f"/proc/{pid}/fd"))
            log = sim.tmp / "daemon.log"
            registered = 0
            with contextlib.suppress(OSError):
                registered = sum(len(g.containers) for g in treefs.read_tree(self.tree_root).gpus)
            regions = len(os.listdir(sim.region_dir)) if sim.region_dir.is_dir() else 0
            snapshot = read_snapshot(sim.state_dir / "snapshot.json") if pid else None
            late = {g.index: (g.dispatch_late_wakes, g.dispatch_late_seconds)
                    for g in snapshot.gpus} if snapshot is not None and snapshot.pid == pid else {}
            record.samples.append(Sample(self.now(record), pid, rss, fds,
                                         log.stat().st_size if log.exists() else 0,
                                         registered, regions, late))

    # -- pairs --

    def pair(self, record: Record, event: Pair,
             ready: tuple[list[Made], dict[tuple[int, int], ShareJob]] | None = None) -> None:
        """Start the pair's containers on every GPU (unless `ready`), run their workloads
        to `until`, read their counts, remove them."""
        made, jobs = ready or self.make_pair(
            event, lambda: record.t0 + event.until - time.monotonic() - 3)
        try:
            if not jobs:
                return
            go = max(time.monotonic() + 0.5, record.t0 + 0.5)
            for job in jobs.values():
                job.go(go)
            seconds = record.t0 + event.until - go
            runs = {gpu: PairRun(gpu, go - record.t0, event.until) for gpu, _, _ in made}
            with self.lock:
                record.pairs.extend(runs.values())
                record.applied.append(replace(event, at=go - record.t0))
                self.pair_of.update({gpu: (one.id12, two.id12) for gpu, one, two in made})
            while time.monotonic() < go + seconds:
                for gpu, one, two in made:
                    present = all((self.tree_root / str(gpu) / c.id12).exists()
                                  for c in (one, two))
                    runs[gpu].registered.append((self.now(record), present))
                time.sleep(0.5)
            for (gpu, k), job in jobs.items():
                with contextlib.suppress(ProcessLookupError):
                    job.popen.terminate()  # runc exec forwards it: sharework reports
                try:
                    report = job.report(timeout=60)
                except (AssertionError, ValueError, subprocess.TimeoutExpired):
                    continue
                if k == 0:
                    runs[gpu].first = report
                else:
                    runs[gpu].second = report
        finally:
            assert self.node is not None
            for _gpu, one, two in made:
                self.node.remove(one, keep_rootfs=True)
                self.node.remove(two, keep_rootfs=True)

    def make_pair(self, event: Pair, seconds: Callable[[], float]
                  ) -> tuple[list[Made], dict[tuple[int, int], ShareJob]]:
        """The pair's containers, and in each a workload ready to go that runs
        `seconds()` (as it is once the containers run; none when under 3 s)."""
        assert self.node is not None
        node = self.node
        base = self.base_container

        def start(gpu: int, weight: int) -> Container:
            """A pair's container, on the root filesystem of the soak's first one."""
            container, code, errors = node.try_container(
                {"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "ALIYUN_COM_GPU_MEM_DEV": "15",
                 "ALIYUN_COM_GPU_SCHD_WEIGHT": str(weight), "NVIDIA_VISIBLE_DEVICES": str(gpu)},
                rootfs_of=base)
            self.ids.add(container.id)
            if code != 0:
                node.remove(container, keep_rootfs=True)
                raise RuntimeError(f"a pair's container: {last_error(errors)}")
            return container

        made: list[Made] = []
        with ThreadPoolExecutor(max_workers=4) as starting:
            futures = {gpu: [starting.submit(start, gpu, w) for w in event.weights[gpu]]
                       for gpu in range(self.gpus)}
            for gpu, (f1, f2) in futures.items():
                try:
                    made.append((gpu, f1.result(), f2.result()))
                except RuntimeError as error:
                    print(f"soak: GPU {gpu}: {error}", flush=True)
        length = seconds()
        if length < 3:
            return made, {}
        jobs = {(gpu, k): ShareJob(c, PAIR_US, length)
                for gpu, one, two in made for k, c in enumerate((one, two))}
        for job in jobs.values():
            job.wait_ready(60)
        return made, jobs

    # -- churn --

    def churn(self, record: Record, event: Start) -> None:
        spec = event.container
        probe = Probe(event.number, spec.engine, spec.gpu, "", spec.limit)
        with self.lock:
            record.probes.append(probe)
        env = {**dict(spec.env), "NVIDIA_VISIBLE_DEVICES": str(spec.gpu)}
        try:
            if spec.engine == "docker":
                self.docker_life(record, event, env, probe)
            else:
                self.runc_life(record, event, env, probe)
        except Exception as error:  # a failed step is a figure, not the end of the soak
            probe.error = probe.error or f"{type(error).__name__}: {error}"[:200]
        finally:
            with self.lock:
                self.live[spec.gpu] = [(n, p) for n, p in self.live[spec.gpu] if p is not probe]

    def docker_life(self, record: Record, event: Start, env: Mapping[str, str],
                    probe: Probe) -> None:
        assert self.docker is not None
        spec = event.container
        name = f"soak{event.number}"
        script = (f"{probe_script(spec.limit)}; "
                  f"cuworkload --kernels {spec.kernels} --us {spec.us} --report 50; sleep 600")
        args = [f"--env={k}={v}" for k, v in env.items()]
        started = self.docker.docker("run", "-d", "--runtime=cgpu", "--network=none",
                                     "--name", name, *args, IMAGE, "sh", "-c", script)
        if started.returncode != 0:
            probe.error = last_error(started.stderr)
            self.docker.docker("rm", "-f", name)
            return
        full = started.stdout.strip()
        self.ids.add(full)
        probe.id12 = full[:12]
        probe.started = self.now(record)
        end = record.t0 + event.at + spec.lifetime
        logs = ""
        while time.monotonic() < end:
            logs = self.docker.docker("logs", name).stdout
            if "probed" in logs and probe.total is None:
                read_probe(logs, probe)
                with self.lock:
                    self.live[spec.gpu].append((probe.id12, probe))
            time.sleep(0.5)
        logs = self.docker.docker("logs", name).stdout
        if probe.total is None:
            read_probe(logs, probe)
        probe.kernels = kernels_done(logs)
        self.docker.docker("rm", "-f", name)
        probe.stopped = self.now(record)

    def runc_life(self, record: Record, event: Start, env: Mapping[str, str],
                  probe: Probe) -> None:
        assert self.node is not None
        spec = event.container
        container, code, errors = self.node.try_container(env, rootfs_of=self.base_container)
        self.ids.add(container.id)
        probe.id12 = container.id12
        try:
            if code != 0:
                probe.error = last_error(errors)
                return
            probe.started = self.now(record)
            read_probe(container.sh(probe_script(spec.limit, "/"), timeout=60), probe)
            with self.lock:
                self.live[spec.gpu].append((probe.id12, probe))
            out = container.out / "work.log"
            args = container.exec_args(["/cuworkload", "--kernels", str(spec.kernels), "--us",
                                        str(spec.us), "--report", "50"])
            with out.open("wb") as log:
                work = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT)
            time.sleep(max(0.0, record.t0 + event.at + spec.lifetime - time.monotonic()))
            probe.kernels = kernels_done(out.read_text(errors="replace"))
            work.kill()
            work.wait(timeout=30)
        finally:
            self.node.remove(container, keep_rootfs=True)
            probe.stopped = self.now(record)

    # -- live writes --

    def write(self, record: Record, event: Write) -> None:
        node, gpu = event.node, event.gpu
        try:
            if node == "memsize":
                with self.lock:
                    live = [name for name, p in self.live[gpu] if p.total is not None]
                if not live:
                    record.writes.append((event, "skipped: no container"))
                    return
                relpath = f"{gpu}/{live[event.pick % len(live)]}/memsize"
            elif node in ("weight1", "weight2"):
                with self.lock:
                    ids = self.pair_of.get(gpu)
                if ids is None:
                    record.writes.append((event, "skipped: no pair"))
                    return
                relpath = f"{gpu}/{ids[int(node[-1]) - 1]}/weight"
            else:
                relpath = f"{gpu}/{node}"
            assert self.node is not None
            self.node.sim.echo(relpath, event.value)
        except OSError as error:
            record.writes.append((event, f"{type(error).__name__}: {error.strerror}"))
            return
        record.writes.append((event, ""))
        with self.lock:
            record.applied.append(replace(event, at=self.now(record)))

    # -- faults --

    def fault(self, record: Record, event: Fault) -> None:
        assert self.node is not None
        assert self.tree is not None
        fault = FaultRecord(event.kind, self.now(record), event.gpu)
        with self.lock:
            record.faults.append(fault)
        sim = self.node.sim
        try:
            if event.kind == "daemon-kill":
                before = self.region_names()
                fault.trigger = self.now(record)
                sim.kill_daemon(signal.SIGKILL)
                sim.start_daemon(PERIOD)
                fault.done = self.now(record)
                fault.lost = self.unstamped(before, time.monotonic_ns())
            elif event.kind == "upgrade":
                before = self.region_names()
                mark = time.monotonic_ns()
                fault.trigger = self.now(record)
                (self.tree_root / "upgrade").write_text("1\n")
                deadline = time.monotonic() + 60
                while (self.tree_root / "upgrade").read_text().strip() != "0":
                    if time.monotonic() > deadline:
                        fault.note = "upgrade still 1 after 60 s"
                        break
                    time.sleep(0.1)
                fault.done = self.now(record)
                fault.lost = self.unstamped(before, mark)
            elif event.kind == "fuse-kill":
                fault.trigger = self.now(record)
                self.tree.process.kill()
                self.tree.process.wait(timeout=30)
                # A dead FUSE mount: os.path.ismount says no (ENOTCONN), so unmount it here.
                subprocess.run(["fusermount", "-u", "-z", str(self.tree_root)],
                               capture_output=True, check=False)
                self.tree = MountedTree(self.tree_root, self.gpus)
                self.setup_tree()
                with self.lock:
                    record.applied += [Write(self.now(record), g, "policy", INITIAL_POLICY)
                                       for g in range(self.gpus)]
                fault.done = self.now(record)
            elif event.kind == "launch-kill":
                self.launch_kill(record, fault)
            elif event.kind == "oom-hang":
                self.oom_hang(record, fault)
            elif event.kind == "bypass":
                self.bypass(record, fault)
        except Exception as error:
            fault.note = f"{type(error).__name__}: {error}"[:200]

    def region_names(self) -> set[str]:
        assert self.node is not None
        folder = self.node.sim.region_dir
        return set(os.listdir(folder)) if folder.is_dir() else set()

    def unstamped(self, before: set[str], mark_ns: int, timeout: float = 20) -> list[str]:
        """Regions there before a restart, still there, whose heartbeat the daemon has
        not stamped since `mark_ns` within `timeout` s: containers it lost track of."""
        assert self.node is not None
        deadline = time.monotonic() + timeout
        while True:
            waiting = []
            for name in sorted(before & self.region_names()):
                path = region_mod.region_path(name, self.node.sim.region_dir)
                try:
                    with region_mod.Region.open(path) as region:
                        stamped = region.heartbeat_ns > mark_ns
                except (OSError, region_mod.RegionError):
                    continue  # gone meanwhile
                if not stamped:
                    waiting.append(name)
            if not waiting or time.monotonic() > deadline:
                return waiting
            time.sleep(0.25)

    def fault_container(self, gpu: int, **options: object) -> Container:
        assert self.node is not None
        env = options.pop("env", None) or {"ALIYUN_COM_GPU_MEM_CONTAINER": "1",
                                            "ALIYUN_COM_GPU_MEM_DEV": "15"}
        assert isinstance(env, dict)
        if "files" not in options:
            options["rootfs_of"] = self.base_container
        container, code, errors = self.node.try_container(
            {**env, "NVIDIA_VISIBLE_DEVICES": str(gpu)}, **options)  # type: ignore[arg-type]
        if code != 0:
            self.node.remove(container, keep_rootfs="files" not in options)
            raise RuntimeError(last_error(errors))
        self.ids.add(container.id)
        return container

    def launch_kill(self, record: Record, fault: FaultRecord) -> None:
        """A workload SIGKILLed while it launches (its gate open or closed)."""
        assert self.node is not None
        container = self.fault_container(fault.gpu)
        try:
            job = ShareJob(container, 1000, 30)
            job.wait_ready(60)
            job.go(time.monotonic())
            time.sleep(1.5)
            victims = pidns_processes(container.pidns(), container.init_pid())
            fault.trigger = self.now(record)
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            job.popen.wait(timeout=30)
            fault.done = self.now(record)
            fault.note = f"{len(victims)} processes killed"
        finally:
            self.node.remove(container, keep_rootfs=True)

    def oom_hang(self, record: Record, fault: FaultRecord) -> None:
        """An eGPU process over its lowered limit, whose OOM script never ends."""
        assert self.node is not None
        container = self.fault_container(
            fault.gpu, env={"AMP_VGPU_ENABLE": "1", "GPU_MEM_PER_DEVICE": str(1034 * MIB),
                            "ALIYUN_COM_GPU_OOM_SCRIPT": OOM_SCRIPT},
            files={OOM_SCRIPT: "#!/bin/sh\nsleep 30\n"})
        try:
            proc = container.proc()
            answer = proc.ask(f"alloc {64 * MIB}")
            if answer != "alloc rc=0":
                fault.note = answer
                return
            fault.trigger = self.now(record)
            self.node.echo(f"{fault.gpu}/{container.id12}/memsize", MIB)
            status = proc.wait(60)
            fault.done = self.now(record)
            fault.note = f"exit status {status}"
        finally:
            self.node.remove(container)

    def bypass(self, record: Record, fault: FaultRecord) -> None:
        """A workload that launches past libcgpu's gate (rawlaunch), beside an honest one."""
        assert self.node is not None

        container = self.fault_container(fault.gpu)
        try:
            job = ShareJob(container, 1000, 30, env=RAW)
            job.wait_ready(60)
            job.go(time.monotonic())
            fault.trigger = self.now(record)
            init = container.init_pid()
            running = pidns_processes(container.pidns(), init)
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline:
                if len(pidns_processes(container.pidns(), init)) < len(running):
                    fault.done = self.now(record)  # the daemon stopped one
                    break
                time.sleep(0.05)
            else:
                fault.note = "no process stopped in 40 s"
        finally:
            self.node.remove(container, keep_rootfs=True)

    # -- the end --

    def settle(self, record: Record, timeout: float = 60) -> None:
        """Wait for what the churn left to go (the daemon's reclaim, the hooks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(self.leftovers().values()):
            time.sleep(0.5)

    def leftovers(self) -> dict[str, list[str]]:
        """What remains of the soak's containers once every one has gone."""
        assert self.node is not None
        assert self.docker is not None
        sim = self.node.sim
        tree: list[str] = []
        with contextlib.suppress(OSError):
            tree = [f"{g.index}/{name}" for g in treefs.read_tree(self.tree_root).gpus
                    for name in g.containers]
        mounts = []
        with open("/proc/self/mountinfo") as mountinfo:
            for line in mountinfo:
                point = line.split()[4]
                if point.startswith(str(self.folder)) and point != str(self.tree_root) \
                        and "/docker/" not in point:
                    mounts.append(point)
        cgroups = []
        ids = {i[:12] for i in self.ids}
        for dirpath, dirnames, _ in os.walk("/sys/fs/cgroup"):
            for name in dirnames:
                if any(i in name for i in ids):
                    cgroups.append(os.path.join(dirpath, name))
            if dirpath.count("/") > 6:
                dirnames[:] = []
        state = sim.state_dir / "daemon-state.json"
        stale = []
        if state.exists():
            text = state.read_text()
            stale = [i for i in ids if i in text]
        return {
            "tree": tree,
            "regions": sorted(os.listdir(sim.region_dir)) if sim.region_dir.is_dir() else [],
            "claims": sorted(os.listdir(self.node.claims)) if self.node.claims.is_dir() else [],
            "mounts": mounts,
            "cgroups": cgroups,
            "state": stale,
            "docker": self.docker.docker("ps", "-aq").stdout.split(),
            "runc": [c.id for c in self.node.containers],
        }


@contextlib.contextmanager
def soak_node(gpus: int, out: Path) -> Iterator[Soak]:
    with Soak(gpus, out) as soak:
        yield soak


def run_plan(seed: int, seconds: float, gpus: int, out: Path) -> tuple[list[Event], Record]:
    events = soak_plan.make_plan(seed, seconds, gpus)
    with soak_node(gpus, out) as soak:
        return events, soak.run(events, seconds)
