"""The whole-node checks, run inside the VM by cgpu-node-test.service (see run.sh).

    python3 checks.py REPO

The guest is a bare node: the host's root read-only with a tmpfs overlay,
systemd as PID 1, simgpu as the GPU, no cgpu_km installed. These checks
install the project the way an operator does (`cgpu-node install`), then
drive the node through the kernel module's tree /proc/cgpu_km: the units
(cgpu-kmod, cgpu-daemon), jobs (`cgpu-run`), a runc container through
`cgpu-container-runtime`, shares counted by the workloads, live tuning,
cgpu-smi, /metrics, and failure and recovery under systemd.

Each check prints one line, `PASS name: detail` or `FAIL name: detail`;
then `CGPU-NODE-RESULT: PASS` or `FAIL`. A phase that cannot go on fails
with its reason and the phases after it are reported as not run. Only the
standard library is used (the guest runs it with /usr/bin/python3).
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

TREE = Path("/proc/cgpu_km")
BIN = Path("/usr/local/bin")
PREFIX = Path("/opt/cgpu_km")
MIB = 1 << 20
# Two GPUs of different sizes, so that the module's parameters cannot be defaults.
SIMGPU_DEVICES = "Tesla T4:15109MiB,Tesla V100-SXM2-16GB:16160MiB"
GPU_TOTALS = (15109 * MIB, 16160 * MIB)
METRICS = "http://127.0.0.1:9400/metrics"
US = 2000  # sharework's kernels: 2 ms of GPU time each
# A window's share is judged within 15% where the jobs kept the GPU at least 70%
# busy (their own counts), within a third where they did not. Why: in a TCG guest
# that the host starves of CPU, a holder's process cannot launch during its turn,
# simgpu's engine (wall time) idles, and that idle is charged to whoever held:
# noise per window, either way, in the counts and not in the charged time. On
# this 2-core host at 89f365c, quiet: 80-84% busy, counts within 3.4%; beside 2
# busy loops: 51-62% busy, within 10.5%; beside 3: 35-44% busy, within 13.8%;
# the charged time within 8.8% throughout (90b9cb8, quiet: within 3.8%). A third
# still tells each target from the others (bands 0.34-0.66, 0.67-1.33, 1.34-2.66).
SHARE_TOLERANCE = 0.15
STARVED_TOLERANCE = 0.33
STARVED_BELOW = 0.70  # GPU busy, from the jobs' counts
GATE_TIMEOUT = 2.0  # the region's heartbeat timeout, seconds
HELD_BEATS = 6  # the daemon's heartbeats (0.5 s apart) over which a held job runs nothing
REGIONS = Path("/run/cgpu_km-regions")  # CGPU_REGION_DIR of cgpu-daemon.service
# The region's control part starts with magic (u64), version, size, ngpus, mode (u32
# each), then the heartbeat: CLOCK_MONOTONIC ns of the daemon's last stamp (0: gone).
HEARTBEAT = struct.Struct("<Q")
HEARTBEAT_OFFSET = 24
# The account part: a 128-byte header (slots_used, u32, at 16), then process slots of
# 2112 bytes, each its state (u32, 2: live) and from 64 a 128-byte line per GPU, which
# at 96 says how its last launch that waited at the closed gate until the heartbeat
# was stale went on: the heartbeat it judged stale, when its last timed wait was to
# end, when it went on (u64 each, CLOCK_MONOTONIC ns; 0 at the end: none did).
SLOTS_USED_OFFSET, SLOTS_OFFSET, SLOT_SIZE, SLOT_LIVE = 16, 128, 2112, 2
GPU_LINES_OFFSET, GPU_LINE_SIZE, FAILED_OPEN_OFFSET = 64, 128, 96
FAILED_OPEN = struct.Struct("<QQQ")
UNITS = ("cgpu-kmod.service", "cgpu-daemon.service", "cgpu-fuse.service")
DROPIN = Path("/run/systemd/system/cgpu-kmod.service.d/zz-node-test.conf")
DROPIN_FUSE = Path("/run/systemd/system/cgpu-fuse.service.d/zz-node-test.conf")


class Abort(Exception):
    """A phase cannot go on; `str(error)` says why."""


def uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def say(line: str) -> None:
    print(line, flush=True)


@dataclass
class Results:
    failed: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str) -> bool:
        say(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
        if not ok:
            self.failed.append(name)
        return ok


# --- small tools ---------------------------------------------------------------

def run(*args: str, timeout: float = 120, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          env=env, check=False)


def show(unit: str, *props: str) -> dict[str, str]:
    out = run("systemctl", "show", unit, "-p", ",".join(props)).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def journal_entries(unit: str, since_usec: int = 0) -> list[tuple[float, str]]:
    """The unit's journal from CLOCK_MONOTONIC microseconds `since_usec` on:
    (seconds, message) as journald received them."""
    out = run("journalctl", "-u", unit, "--no-pager", "-o", "json",
              "--output-fields=MESSAGE").stdout
    entries = []
    for record in out.splitlines():
        with suppress(ValueError):
            entry = json.loads(record)
            stamp = int(entry.get("__MONOTONIC_TIMESTAMP", 0))
            if stamp >= since_usec and isinstance(entry.get("MESSAGE"), str):
                entries.append((stamp / 1e6, entry["MESSAGE"]))
    return entries


def journal(unit: str, since_usec: int = 0) -> str:
    return "\n".join(message for _, message in journal_entries(unit, since_usec))


def monotonic_usec() -> int:
    return time.monotonic_ns() // 1000


def wait_for(what: str, predicate: Callable[[], bool], timeout: float,
             interval: float = 0.05) -> float:
    """Poll until `predicate()`; the monotonic time it first held. Abort on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise Abort(f"{what}: not within {timeout:g} s")
        time.sleep(interval)


def heartbeat(container: str) -> float:
    """The daemon's last stamp in `container`'s region, CLOCK_MONOTONIC seconds."""
    with (REGIONS / container / "control").open("rb") as control:
        control.seek(HEARTBEAT_OFFSET)
        ns = int(HEARTBEAT.unpack(control.read(HEARTBEAT.size))[0])
    return ns / 1e9


def heartbeats(container: str, count: int, after: float, timeout: float = 120) -> float:
    """Wait until the daemon has stamped `container`'s region `count` times after the
    time `after` (its dispatcher does every 0.5 s); the time of the last stamp. What a
    check that nothing happens waits for: the daemon's own rounds, not a time. Abort
    after `timeout` (a hang guard)."""
    stamps: set[float] = set()
    deadline = time.monotonic() + timeout
    while len(stamps) < count:
        if time.monotonic() > deadline:
            raise Abort(f"{container}: {len(stamps)} heartbeats of {count} "
                        f"within {timeout:g} s")
        if (stamp := heartbeat(container)) > after:
            stamps.add(stamp)
        time.sleep(0.02)
    return max(stamps)


def failed_open(region: Path, gpu: int = 0) -> tuple[int, int, int] | None:
    """The latest launch on container GPU `gpu` that failed open after waiting, as
    its process recorded it in the account of `region` (a region's folder): the
    heartbeat it judged stale, when its last timed wait was to end and when it went
    on (CLOCK_MONOTONIC ns), or None."""
    data = (region / "account").read_bytes()
    used = min(struct.unpack_from("<I", data, SLOTS_USED_OFFSET)[0], 256)
    found = []
    for slot in range(used):
        base = SLOTS_OFFSET + slot * SLOT_SIZE
        if struct.unpack_from("<I", data, base)[0] != SLOT_LIVE:
            continue
        line = base + GPU_LINES_OFFSET + gpu * GPU_LINE_SIZE + FAILED_OPEN_OFFSET
        stale, wake, went = FAILED_OPEN.unpack_from(data, line)
        if went:
            found.append((int(stale), int(wake), int(went)))
    return max(found, key=lambda record: record[2], default=None)


def tree(relpath: str) -> str:
    return (TREE / relpath).read_text().strip()


def echo(value: int, relpath: str) -> None:
    """`echo VALUE > /proc/cgpu_km/RELPATH`."""
    with (TREE / relpath).open("w") as node:
        node.write(f"{value}\n")


def metrics() -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    with urllib.request.urlopen(METRICS, timeout=10) as answer:
        text = answer.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def sample(samples: dict[str, float], name: str, **labels: str) -> float | None:
    """The value of the sample `name` whose labels include `labels`."""
    for key, value in samples.items():
        if key.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
    return None


# --- workloads -----------------------------------------------------------------

@dataclass(frozen=True)
class Report:
    """What a `sharework` run counted: completed kernels per bucket since t0."""

    t0: float
    bucket: float
    buckets: tuple[int, ...]

    def count(self, start: float, end: float) -> int:
        """Kernels completed in the buckets that lie inside [start, end)."""
        first = max(0, math.ceil((start - self.t0) / self.bucket - 1e-6))
        last = min(len(self.buckets), math.floor((end - self.t0) / self.bucket + 1e-6))
        return sum(self.buckets[first:max(first, last)])

    def first_after(self, start: float) -> float | None:
        """The end of the first bucket after `start` with a completed kernel."""
        first = max(0, math.floor((start - self.t0) / self.bucket + 1e-6))
        for index in range(first, len(self.buckets)):
            if self.buckets[index]:
                return self.t0 + (index + 1) * self.bucket
        return None


def parse_report(text: str) -> Report:
    counts = re.search(r"^counts t0=([\d.]+) bucket_ms=(\d+)", text, re.M)
    buckets = re.search(r"^buckets((?: \d+)*)$", text, re.M)
    if counts is None or buckets is None:
        raise Abort(f"sharework printed no counts: {text[-300:]!r}")
    return Report(float(counts.group(1)), int(counts.group(2)) / 1000,
                  tuple(int(n) for n in buckets.group(1).split()))


class Job:
    """`cgpu-run --name NAME [options] -- COMMAND` with its stdout piped."""

    def __init__(self, logs: Path, name: str, options: Sequence[str],
                 command: Sequence[str]) -> None:
        self.name = name
        self.log = logs / f"{name}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [str(BIN / "cgpu-run"), "--name", name, *options, "--", *command],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self.out = b""

    def _read(self, timeout: float) -> bool:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            return False
        chunk = os.read(fd, 65536)
        self.out += chunk
        return bool(chunk)

    def wait_line(self, word: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.out.decode(errors="replace").splitlines():
                if line.startswith(word):
                    return line
            left = deadline - time.monotonic()
            if left <= 0 or (not self._read(left) and self.process.poll() is not None):
                raise Abort(f"{self.name}: no {word!r} line; output {self.out[-300:]!r}, "
                            f"log {self.log.read_text(errors='replace')[-300:]!r}")

    def go(self, at: float) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"go {at:.9f}\n".encode())
        self.process.stdin.flush()

    def finish(self, timeout: float, status: int = 0) -> str:
        """Wait for the end; all it printed. Abort unless it exited with `status`."""
        try:
            out, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise Abort(f"{self.name}: did not finish within {timeout:g} s") from None
        self.out += out
        if self.process.returncode != status:
            raise Abort(f"{self.name}: exit status {self.process.returncode}: "
                        f"{self.log.read_text(errors='replace')[-300:]!r}")
        return self.out.decode(errors="replace")

    def stop(self) -> None:
        """SIGTERM to cgpu-run, which forwards it to the workload."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def sharework(node: Node, name: str, seconds: float, *options: str) -> Job:
    """A job of `sharework` (the checkout's: the prefix has no benchmark tools)."""
    program = node.repo / "simgpu" / "sharework"
    return node.job(Job(node.work, name, options,
                        [str(program), "--us", str(US), "--seconds", str(seconds),
                         "--bucket-ms", "10", "--go-stdin"]))


def start_together(jobs: Sequence[Job], delay: float = 1.0) -> float:
    """Wait until every job is ready; start them at one time, `delay` ahead."""
    for job in jobs:
        job.wait_line("ready", 90)
    t0 = time.monotonic() + delay
    for job in jobs:
        job.go(t0)
    return t0


def ratio_error(first: int, second: int, target: float) -> float:
    """How far first/second is from `target`, relative to it."""
    if second == 0:
        return float("inf")
    return (first / second) / target - 1


def sleep_until(at: float) -> None:
    time.sleep(max(0.0, at - time.monotonic()))


# --- the runc container ----------------------------------------------------------

class Container:
    """A runc container started through `cgpu-container-runtime`, as an engine would."""

    def __init__(self, work: Path, rootfs: Path, env: dict[str, str],
                 args: Sequence[str]) -> None:
        self.id = "cafe0123456789abcdef"  # the tree uses its first 12 characters
        self.short = self.id[:12]
        self.bundle = work / "bundle"
        self.bundle.mkdir(parents=True)
        spec = run("runc", "spec", "--bundle", str(self.bundle))
        if spec.returncode != 0:
            raise Abort(f"runc spec: {spec.stderr.strip()}")
        config = json.loads((self.bundle / "config.json").read_text())
        config["root"] = {"path": str(rootfs), "readonly": True}
        config["process"]["terminal"] = False
        config["process"]["args"] = list(args)
        config["process"]["env"] = ["PATH=/bin:/usr/bin", *(f"{k}={v}" for k, v in env.items())]
        (self.bundle / "config.json").write_text(json.dumps(config))
        self.output = self.bundle / "output"

    def runtime(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run(str(BIN / "cgpu-container-runtime"), *args, timeout=timeout)

    def start(self) -> subprocess.CompletedProcess[bytes]:
        """`run --detach`: its stdout and stderr go to a file."""
        with self.output.open("w") as out:
            return subprocess.run(
                [str(BIN / "cgpu-container-runtime"), "run", "--detach", "--bundle",
                 str(self.bundle), self.id], stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, timeout=180, check=False)

    def exec(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.runtime("exec", self.id, *args)

    def remove(self) -> None:
        self.runtime("kill", self.id, "KILL")
        self.runtime("delete", "--force", self.id)


# --- the node ------------------------------------------------------------------

@dataclass
class Node:
    repo: Path
    work: Path
    results: Results
    jobs: list[Job] = field(default_factory=list)
    container: Container | None = None

    def check(self, name: str, ok: bool, detail: str) -> bool:
        return self.results.check(name, ok, detail)

    def job(self, job: Job) -> Job:
        self.jobs.append(job)
        return job

    def daemon(self) -> dict[str, str]:
        return show("cgpu-daemon.service", "ActiveState", "SubState", "MainPID", "NRestarts",
                    "StatusText", "Result", "WatchdogUSec", "WatchdogTimestampMonotonic",
                    "ExecMainStartTimestampMonotonic")

    def cleanup(self) -> None:
        for job in self.jobs:
            job.kill()
        if self.container is not None:
            self.container.remove()


def phase(name: str) -> None:
    say(f"CGPU-NODE: [{uptime():.1f}s] {name}")


# -- 1. install -----------------------------------------------------------------

def simgpu_devices(node: Node) -> None:
    """The node's GPUs: simgpu's state, made once with two devices (as a driver has them)."""
    env = {**os.environ, "SIMGPU_DEVICES": SIMGPU_DEVICES}
    listed = run(str(node.repo / "simgpu" / "nvidia-smi"), "-L", env=env)
    if listed.returncode != 0 or listed.stdout.count("GPU ") != 2:
        raise Abort(f"simgpu's nvidia-smi -L: {listed.stdout}{listed.stderr}")


def install(node: Node) -> None:
    phase("install: cgpu-node install")
    wheels = sorted((node.repo / "kmod" / "build" / "node" / "wheel").glob("cgpu_km-*.whl"))
    if not wheels:
        raise Abort("no cgpu_km wheel in kmod/build/node/wheel (run.sh builds it)")
    started = time.monotonic()
    result = run(str(node.repo / ".venv" / "bin" / "cgpu-node"), "install", "--engines", "",
                 "--simulate", "on", "--wheel", str(wheels[-1]), timeout=600)
    took = time.monotonic() - started
    for line in (result.stdout + result.stderr).splitlines():
        say(f"# {line}")
    if not node.check("install: cgpu-node install exits 0", result.returncode == 0,
                      f"status {result.returncode} in {took:.0f} s"):
        raise Abort("the install failed")
    python = (PREFIX / "venv" / "bin" / "python").resolve()
    node.check("install: the venv's interpreter is outside /root, /home and /run/user",
               not str(python).startswith(("/root/", "/home/", "/run/user/")), str(python))
    daemon = (BIN / "cgpu-daemon").resolve()
    node.check("install: /usr/local/bin/cgpu-daemon is the prefix's",
               daemon == PREFIX / "venv" / "bin" / "cgpu-daemon", str(daemon))
    for unit in UNITS:
        installed = Path("/etc/systemd/system") / unit
        same = installed.is_file() and installed.read_text() == \
            (node.repo / "systemd" / unit).read_text()
        node.check(f"install: {unit} installed unchanged (hardening included)", same,
                   str(installed))


# -- 2. the module and the units -----------------------------------------------

def kmod(node: Node) -> None:
    phase("kmod: cgpu-kmod.service")
    state = show("cgpu-kmod.service", "ActiveState", "Result")
    node.check("kmod: cgpu-kmod.service is active", state.get("ActiveState") == "active",
               str(state))
    params = Path("/sys/module/cgpu_km/parameters")
    if not params.is_dir():
        raise Abort("cgpu_km is not loaded")
    gpus = (params / "gpus").read_text().strip()
    node.check("kmod: gpus= is NVML's device count", gpus == "2", f"gpus={gpus}")
    node.check("kmod: the tree has GPUs 0 and 1 only",
               (TREE / "1").is_dir() and not (TREE / "2").exists(),
               " ".join(sorted(p.name for p in TREE.iterdir())))
    smi = run(str(BIN / "cgpu-daemon"), "--module-params").stdout.strip()
    want = f"gpus=2 gpu_mem={GPU_TOTALS[0]},{GPU_TOTALS[1]}"
    node.check("kmod: cgpu-daemon --module-params gives NVML's totals", smi == want, smi)
    node.check("kmod: the unit passed NVML's memory (meminfo of a whole-GPU container)",
               whole_gpu_free(1) == GPU_TOTALS[1], f"GPU 1 Free: {whole_gpu_free(1)}")
    fuse = show("cgpu-fuse.service", "ActiveState", "ConditionResult")
    node.check("kmod: cgpu-fuse.service stays off while the module serves the tree",
               fuse.get("ActiveState") == "inactive" and fuse.get("ConditionResult") == "no",
               str(fuse))


def whole_gpu_free(gpu: int) -> int:
    """meminfo's Free of a container made without a memsize (the module's gpu_mem)."""
    with (TREE / "inst_ctl").open("w") as ctl:
        ctl.write(f"add {gpu} gpumem-probe\n")
    try:
        first = tree(f"{gpu}/gpumem-probe/meminfo").splitlines()[0]
    finally:
        with (TREE / "inst_ctl").open("w") as ctl:
            ctl.write("del gpumem-probe\n")
    return int(first.split()[1])


def daemon_up(node: Node) -> None:
    phase("daemon: cgpu-daemon.service")
    state = node.daemon()
    node.check("daemon: READY (Type=notify, active/running)",
               state.get("ActiveState") == "active" and state.get("SubState") == "running",
               f"{state.get('ActiveState')}/{state.get('SubState')}")
    node.check("daemon: its status names 2 GPUs", "2 GPUs" in state.get("StatusText", ""),
               state.get("StatusText", ""))
    node.check("daemon: WatchdogSec=10s", state.get("WatchdogUSec") == "10s",
               state.get("WatchdogUSec", ""))
    pid = state.get("MainPID", "0")
    argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    exe = os.readlink(f"/proc/{pid}/exe")
    node.check("daemon: runs the prefix's venv on an interpreter outside /root and /home",
               argv0 == str(PREFIX / "venv" / "bin" / "python")
               and exe.startswith("/usr/"), f"{argv0} -> {exe}")
    # inotify on the tree only sees writes made through the same procfs instance.
    inside = run("nsenter", "-t", pid, "-m", "--", "stat", "-c", "%d", str(TREE / "version"))
    outside = os.stat(TREE / "version").st_dev
    node.check("daemon: its /proc/cgpu_km is the host's procfs (inotify sees echo's writes)",
               inside.stdout.strip() == str(outside),
               f"device {inside.stdout.strip() or inside.stderr.strip()} inside, "
               f"{outside} outside")
    node.check("daemon: each GPU's dispatcher thread under SCHED_FIFO 1 (LimitRTPRIO=1), "
               "the others under SCHED_OTHER", *dispatch_policies(int(pid)))
    samples = metrics()
    totals = [sample(samples, "cgpu_gpu_memory_total_bytes", gpu=str(g)) for g in (0, 1)]
    node.check("daemon: /metrics answers with both GPUs' totals",
               totals == [float(t) for t in GPU_TOTALS], str(totals))


def dispatch_policies(pid: int) -> tuple[bool, str]:
    """Whether the daemon's dispatcher threads (named cgpu-gpuN) run under SCHED_FIFO 1
    and its other threads under SCHED_OTHER, as the kernel says; what it says."""
    fifo = os.SCHED_FIFO | os.SCHED_RESET_ON_FORK
    names = {fifo: "FIFO (reset on fork)", os.SCHED_OTHER: "OTHER"}
    seen: dict[str, set[str]] = {}
    ok = True
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            policy = os.sched_getscheduler(int(task.name))
            priority = os.sched_getparam(int(task.name)).sched_priority
        except (FileNotFoundError, ProcessLookupError):  # the thread ended
            continue
        dispatcher = name.startswith("cgpu-gpu")
        ok = ok and (policy, priority) == ((fifo, 1) if dispatcher else (os.SCHED_OTHER, 0))
        seen.setdefault(name if dispatcher else "the others", set()).add(
            f"{names.get(policy, str(policy))} {priority}")
    dispatchers = sum(name.startswith("cgpu-gpu") for name in seen)
    return ok and dispatchers == 2, "; ".join(
        f"{name}: {', '.join(sorted(policies))}" for name, policies in sorted(seen.items()))


def watchdog_kept(node: Node, before: dict[str, str]) -> None:
    after = node.daemon()
    then = int(before.get("WatchdogTimestampMonotonic", "0"))
    now = int(after.get("WatchdogTimestampMonotonic", "0"))
    node.check("daemon: keeps its watchdog (WATCHDOG=1 seen again, no restart)",
               now > then > 0 and after.get("NRestarts") == before.get("NRestarts")
               and after.get("MainPID") == before.get("MainPID"),
               f"last ping {then / 1e6:.1f} s -> {now / 1e6:.1f} s, "
               f"NRestarts {after.get('NRestarts')}")


# -- 3. shares and live tuning --------------------------------------------------

def shares(node: Node) -> None:
    """Two jobs of weights 1 and 2 under policy 1, then 2 (echo), then weight 1 -> 4."""
    phase("shares: two sharework jobs, policy 1 -> 2 -> weight 4")
    before = node.daemon()
    seconds, step = 15.0, 5.0  # 4 s windows after 1 s to settle
    a = sharework(node, "job-a", seconds, "--weight", "1")
    b = sharework(node, "job-b", seconds, "--weight", "2")
    with ChargedLog(("job-a", "job-b")) as charged:
        t0 = start_together([a, b])
        sleep_until(t0 + 2)
        smi = run(str(BIN / "cgpu-smi")).stdout
        node.check("smi: cgpu-smi shows both jobs", "job-a" in smi and "job-b" in smi,
                   " ".join(line.strip() for line in smi.splitlines() if "job-" in line)[:200])
        sleep_until(t0 + step)
        echo(2, "0/policy")
        policy_at = time.monotonic()
        sleep_until(t0 + 2 * step)
        echo(4, "0/job-a/weight")
        weight_at = time.monotonic()
        target = wait_target_share(0.667, "job-a", 3.0)
        node.check("tuning: /metrics' target share of job-a follows weight 4 of 6",
                   target is not None and abs(target - 4 / 6) < 0.01, f"{target}")
        reports = {job.name: parse_report(job.finish(seconds + 60)) for job in (a, b)}
        sleep_until(t0 + seconds + 2.5)  # the daemon's snapshot after the end
    for snapshot in charged.snapshots:
        counted = [reports[n].count(t0, snapshot.at) * US / 1e6 for n in charged.names]
        say(f"# charged at {snapshot.at - t0:6.2f} s: " + "  ".join(
            f"{n} {snapshot.used[n]:7.3f} s (counted {k:7.3f} s)"
            for n, k in zip(charged.names, counted, strict=True)))
    windows = (("policy 1: 1:1", t0 + 1, policy_at, 1.0),
               ("echo 2 > 0/policy: 1:2", policy_at + 1, weight_at, 0.5),
               ("echo 4 > 0/job-a/weight: 4:2", weight_at + 1, t0 + seconds, 2.0))
    for label, start, end, target_ratio in windows:
        ka, kb = reports["job-a"].count(start, end), reports["job-b"].count(start, end)
        error = ratio_error(ka, kb, target_ratio)
        busy = (ka + kb) * US / 1e6 / (end - start)
        starved = busy < STARVED_BELOW
        tolerance = STARVED_TOLERANCE if starved else SHARE_TOLERANCE
        why = f", a starved guest: under {STARVED_BELOW:.0%}" if starved else ""
        node.check(f"shares: {label} counted in the jobs", abs(error) <= tolerance,
                   f"kernels {ka}:{kb} over {end - start:.1f} s, ratio error {error:+.1%} "
                   f"(tolerance {tolerance:.0%}), GPU busy {busy:.0%}{why}; "
                   f"{charged_beside_counted(charged, reports, start, end, target_ratio)}")
    watchdog_kept(node, before)


@dataclass(frozen=True)
class Charged:
    """The daemon's charged GPU seconds of each job at one snapshot (CLOCK_MONOTONIC s)."""

    at: float
    used: dict[str, float]


class ChargedLog:
    """Every snapshot of /metrics' `cgpu_container_gpu_time_seconds_total` (the
    dispatcher's charged time; published every 2 s) while the jobs run, read in a
    thread, so that a window's charged time can be set beside what the jobs counted
    over the same span."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.snapshots: list[Charged] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> ChargedLog:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()

    def _poll(self) -> None:
        seen = None
        while not self._done.wait(1.0):
            with suppress(OSError, ValueError):
                samples = metrics()
                stamp = sample(samples, "cgpu_snapshot_timestamp_seconds")
                used = {name: sample(samples, "cgpu_container_gpu_time_seconds_total",
                                     container=name) for name in self.names}
                if stamp is None or stamp == seen or None in used.values():
                    continue
                seen = stamp
                at = stamp - (time.time() - time.monotonic())  # the guest's wall -> monotonic
                self.snapshots.append(Charged(at, {n: u or 0.0 for n, u in used.items()}))

    def span(self, start: float, end: float) -> tuple[Charged, Charged] | None:
        """The first and last snapshots within [start, end], if two are."""
        inside = [s for s in self.snapshots if start <= s.at <= end]
        return (inside[0], inside[-1]) if len(inside) >= 2 else None


def charged_beside_counted(log: ChargedLog, reports: dict[str, Report], start: float,
                           end: float, target: float) -> str:
    """The daemon's charged GPU time of each job beside the GPU time its completed
    kernels stand for, over the span of the snapshots inside [start, end]."""
    span = log.span(start, end)
    if span is None:
        return "the daemon's charged time: fewer than two snapshots in the window"
    first, last = span
    charged = [last.used[n] - first.used[n] for n in log.names]
    counted = [reports[n].count(first.at, last.at) * US / 1e6 for n in log.names]
    used = "/".join(f"{k / c:.0%}" if c > 0 else "-" for k, c in zip(counted, charged,
                                                                   strict=True))
    return (f"over its {last.at - first.at:.1f} s between the daemon's snapshots, charged "
            f"{charged[0]:.3f}:{charged[1]:.3f} s (ratio error "
            f"{ratio_error_of(charged, target):+.1%}), counted {counted[0]:.3f}:"
            f"{counted[1]:.3f} s ({ratio_error_of(counted, target):+.1%}): {used} of the "
            f"charged time completed")


def ratio_error_of(pair: Sequence[float], target: float) -> float:
    """`ratio_error` of two GPU times."""
    return pair[0] / pair[1] / target - 1 if pair[1] > 0 else float("inf")


def wait_target_share(value: float, container: str, timeout: float) -> float | None:
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        got = sample(metrics(), "cgpu_container_target_share_ratio", container=container)
        if got is not None and abs(got - value) < 0.01:
            break
        time.sleep(0.2)
    return got


# -- 4. memory limits -------------------------------------------------------------

def limits(node: Node) -> None:
    phase("limits: a cgpu-run job and a runc container")
    limit = 1024 * MIB
    job = Job(node.work, "job-mem", ["--memsize", str(limit)],
              [str(PREFIX / "simgpu" / "cuworkload"), "--alloc", "256MiB", "--alloc", "1GiB"])
    container = start_container(node)
    out = job.finish(120, status=1)  # cuworkload: 1 when an allocation failed
    node.check("limit: cgpu-run --memsize 1GiB: cuMemGetInfo total inside",
               f"total={limit}" in out, one_line(out, "ready"))
    node.check("limit: cgpu-run --memsize 1GiB: 256 MiB fits, 1 GiB more does not",
               f"alloc {256 * MIB} ok" in out
               and f"alloc {1024 * MIB} CUDA_ERROR_OUT_OF_MEMORY" in out,
               " / ".join(line for line in out.splitlines() if line.startswith("alloc")))
    want = GPU_TOTALS[0] * 6 // 15
    registered = container_memsize(container)
    node.check("container: ALIYUN_COM_GPU_MEM_CONTAINER=6 of DEV=15 registered by cgpu-hook",
               registered == want, f"0/{container.short}/memsize {registered}, want {want}")
    inside = container_output(container)
    node.check("container: nvidia-smi inside shows 6043MiB",
               "6043" in one_line(inside, "memory.total"), one_line(inside, "memory.total"))
    node.check("container: cuMemGetInfo total inside is the limit",
               f"total={want}" in inside, one_line(inside, "ready"))
    smi = run(str(BIN / "cgpu-smi")).stdout
    node.check("smi: cgpu-smi shows the container", container.short in smi,
               one_line(smi, container.short).strip()[:120])


def start_container(node: Node) -> Container:
    rootfs = node.repo / "kmod" / "build" / "node" / "rootfs"
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "6", "ALIYUN_COM_GPU_MEM_DEV": "15",
           "NVIDIA_VISIBLE_DEVICES": "0"}
    script = ("echo memory.total $(nvidia-smi --query-gpu=memory.total "
              "--format=csv,noheader,nounits); cuworkload --alloc 1MiB; exec sleep 600")
    container = Container(node.work / "ctr", rootfs, env, ["sh", "-c", script])
    node.container = container
    started = container.start()
    if started.returncode != 0:
        raise Abort(f"cgpu-container-runtime run: {container.output.read_text()[-400:]}")
    return container


def container_memsize(container: Container) -> int | None:
    path = TREE / "0" / container.short / "memsize"
    return int(path.read_text()) if path.exists() else None


def container_output(container: Container) -> str:
    with suppress(Abort):
        wait_for("the container's output", lambda: "ready" in container.output.read_text(), 60)
    return container.output.read_text()


def one_line(text: str, word: str) -> str:
    return next((line for line in text.splitlines() if word in line), f"(no {word!r} line)")


# -- 5. failure and recovery ------------------------------------------------------

@dataclass
class Events:
    """CLOCK_MONOTONIC times of what was done to the daemon."""

    times: dict[str, float] = field(default_factory=dict)
    failed_open: tuple[int, int, int] | None = None  # the held job's record (ns)

    def mark(self, name: str) -> float:
        self.times[name] = time.monotonic()
        return self.times[name]


def recovery(node: Node) -> None:
    """A job that the daemon holds at a closed gate (weight 0) while the daemon is
    killed, restarted by systemd, reloaded, hot-updated and stopped."""
    phase("recovery: a weight-0 job held at its gate")
    echo(2, "0/policy")
    probe = sharework(node, "job-held", 600, "--weight", "0")
    t0 = start_together([probe], delay=0.5)
    events = Events()
    events.times["held"] = t0 + 0.5
    heartbeats("job-held", HELD_BEATS, events.times["held"])
    first = node.daemon()
    since = monotonic_usec()
    events.mark("kill")
    run("systemctl", "kill", "-s", "KILL", "cgpu-daemon.service")
    returned = time.monotonic()
    # When the signal went (systemd logs it as it sends it; by the time systemctl
    # returned at the latest), not when systemctl started (under TCG, 0.1 s before).
    sent = [at for at, message in journal_entries("cgpu-daemon.service", since)
            if message.startswith("Sent signal SIGKILL to main process")]
    if sent:
        events.times["kill"] = min(sent[0], returned)
    wait_for("systemd restarts the daemon", lambda: restarted(node, first), 60)
    events.mark("restarted")
    second = node.daemon()
    # When systemd started the new daemon: the stale heartbeat is the killed one's if it
    # came before. (Not before the signal went: under TCG a SIGKILL reaches a thread on
    # another vCPU tens of milliseconds late, and it may stamp once more meanwhile.)
    events.times["replaced"] = int(second.get("ExecMainStartTimestampMonotonic", "0")) / 1e6
    node.check("kill: systemd restarted the daemon (Restart=always)",
               second.get("NRestarts") == str(int(first.get("NRestarts", "0")) + 1)
               and second.get("MainPID") != first.get("MainPID"),
               f"MainPID {first.get('MainPID')} -> {second.get('MainPID')}, "
               f"NRestarts {second.get('NRestarts')}")
    # held again from the new daemon's third heartbeat (what the job had queued may
    # end after its first), over as many as before the kill
    events.times["restart-held"] = heartbeats("job-held", 3, events.times["restarted"])
    events.failed_open = failed_open(REGIONS / "job-held")
    heartbeats("job-held", HELD_BEATS, events.times["restart-held"])
    reload(node, events)
    upgrade(node, events)
    events.times["upgrade-held"] = heartbeats("job-held", 3, events.times["upgraded"])
    heartbeats("job-held", HELD_BEATS, events.times["upgrade-held"])
    events.mark("stop")
    stop = run("systemctl", "stop", "cgpu-daemon.service")
    events.mark("stopped")
    state = node.daemon()
    node.check("stop: systemctl stop ends the daemon cleanly",
               stop.returncode == 0 and state.get("ActiveState") == "inactive"
               and state.get("Result") == "success", f"{state.get('ActiveState')}, "
               f"result {state.get('Result')}")
    time.sleep(3)  # for the job to run again (the check prints how soon it did)
    probe.stop()
    report = parse_report(probe.finish(60))
    held_checks(node, report, events.times, events.failed_open)


def restarted(node: Node, before: dict[str, str]) -> bool:
    now = node.daemon()
    return (now.get("ActiveState") == "active" and now.get("MainPID") not in
            ("0", before.get("MainPID")))


def reload(node: Node, events: Events) -> None:
    before = node.daemon()
    since = monotonic_usec()
    events.mark("reload")
    result = run("systemctl", "reload", "cgpu-daemon.service")
    wait_for("the daemon's reload in its journal",
             lambda: "reloaded:" in journal("cgpu-daemon.service", since), 30)
    events.mark("reloaded")
    after = node.daemon()
    node.check("reload: systemctl reload (SIGHUP) keeps the daemon",
               result.returncode == 0 and after.get("MainPID") == before.get("MainPID")
               and after.get("ActiveState") == "active",
               f"status {result.returncode}, MainPID {after.get('MainPID')}, "
               f"{after.get('ActiveState')}")
    events.times["reload-held"] = heartbeats("job-held", 1, events.times["reloaded"])
    heartbeats("job-held", HELD_BEATS, events.times["reload-held"])


def upgrade(node: Node, events: Events) -> None:
    before = node.daemon()
    limit = container_memsize(node.container) if node.container else None
    events.mark("upgrade")
    echo(1, "upgrade")
    saw_one = tree("upgrade") == "1"
    done = wait_for("upgrade reads 0 again", lambda: tree("upgrade") == "0", 60)
    events.times["upgraded"] = done
    after = node.daemon()
    node.check("upgrade: echo 1 > upgrade reads 1, then 0 when done",
               saw_one, f"0 again after {done - events.times['upgrade']:.1f} s")
    node.check("upgrade: hot update without a unit restart (same MainPID, NRestarts)",
               after.get("MainPID") == before.get("MainPID")
               and after.get("NRestarts") == before.get("NRestarts")
               and after.get("ActiveState") == "active",
               f"MainPID {before.get('MainPID')} -> {after.get('MainPID')}, "
               f"NRestarts {after.get('NRestarts')}, {after.get('ActiveState')}")
    # The watchdog timer runs on through the exec: the new process pings it as it comes
    # up (a check that it does; how soon is printed).
    def ping() -> float:
        return int(node.daemon().get("WatchdogTimestampMonotonic", "0")) / 1e6

    try:
        pinged = wait_for("a watchdog ping after the hot update", lambda: ping() >= done, 60,
                          interval=0.2)
        detail = (f"first ping seen {pinged - done:.2f} s after upgrade read 0, "
                  f"{done - events.times['upgrade']:.1f} s after the echo")
    except Abort as error:
        pinged, detail = None, str(error)
    restarts = node.daemon().get("NRestarts")
    node.check("upgrade: the new process pings the watchdog (no restart)",
               pinged is not None and restarts == before.get("NRestarts"),
               f"{detail}, NRestarts {restarts}")
    if node.container is None:
        raise Abort("no container to check the limits with")
    node.check("upgrade: the container's limit in the tree is kept",
               container_memsize(node.container) == limit,
               f"{container_memsize(node.container)}")
    inside = node.container.exec("cuworkload", "--alloc", "1MiB")
    want = GPU_TOTALS[0] * 6 // 15
    node.check("upgrade: a new process in the container still gets the limit",
               f"total={want}" in inside.stdout, one_line(inside.stdout + inside.stderr,
                                                          "total"))


def held_checks(node: Node, report: Report, at: dict[str, float],
                record: tuple[int, int, int] | None) -> None:
    """What the held job counted between the events, and what its launch that
    failed open recorded (`failed_open`)."""
    held = report.count(at["held"], at["kill"])
    node.check("gate: closed while the daemon runs (weight 0, policy 2)", held == 0,
               f"{held} kernels in {at['kill'] - at['held']:.1f} s "
               f"({HELD_BEATS} heartbeats or more)")
    opened = report.first_after(at["kill"])
    delay = None if opened is None else opened - at["kill"]
    # That it opens is the check; how long the kernel took is a figure, since a TCG
    # guest on a loaded host is late by any margin. When it opened is asserted from the
    # launch's own record: the killed daemon's last heartbeat, judged stale once it was
    # the gate timeout old, by a timed wait never scheduled past that.
    first = (f"first kernel {delay:.2f} s after SIGKILL" if delay is not None
             else "no kernel after SIGKILL")
    if record is None:
        node.check("kill: the held job's gate fails open after SIGKILL", False,
                   f"{first}; no launch recorded failing open")
    else:
        stale, wake, went = record
        timeout = int(GATE_TIMEOUT * 1e9)
        node.check("kill: the held job's gate fails open after SIGKILL",
                   delay is not None and stale < at["replaced"] * 1e9
                   and went - stale >= timeout and 0 < wake <= stale + timeout,
                   f"{first}; failed open with the heartbeat {(went - stale) / 1e9:.3f} s "
                   f"old (gate timeout {GATE_TIMEOUT:g} s), stamped "
                   f"{stale / 1e9 - at['kill']:+.2f} s from SIGKILL, "
                   f"{at['replaced'] - stale / 1e9:.2f} s before its successor started")
    for label, start, end in (("restart: the restarted daemon holds the gate again",
                               at["restart-held"], at["reload"]),
                              ("reload: held after SIGHUP", at["reload-held"], at["upgrade"]),
                              ("upgrade: held after the hot update", at["upgrade-held"],
                               at["stop"])):
        count = report.count(start, end)
        node.check(label, count == 0 and end > start,
                   f"{count} kernels in {end - start:.1f} s "
                   f"({HELD_BEATS} heartbeats or more)")
    ran = report.first_after(at["stopped"])
    node.check("stop: systemctl stop opens every gate", ran is not None,
               f"first kernel {ran - at['stopped']:.2f} s after the stop" if ran is not None
               else "no kernel after the stop")


# -- 6. the module unit without NVML -------------------------------------------

def kmod_without_nvml(node: Node) -> None:
    phase("kmod: cgpu-kmod.service when NVML cannot give the parameters")
    if node.container is not None:
        node.container.remove()
        node.container = None
    stop = run("systemctl", "stop", "cgpu-kmod.service")
    node.check("kmod: systemctl stop cgpu-kmod unloads the module",
               stop.returncode == 0 and not TREE.exists(), f"status {stop.returncode}")
    for label, setting in (("a broken NVML library", "CGPU_SIMGPU_DIR=/nonexistent"),
                           ("no GPU", "SIMGPU_VISIBLE_DEVICES=")):
        broken_start(node, label, setting)
    DROPIN.unlink(missing_ok=True)
    run("systemctl", "daemon-reload")


def broken_start(node: Node, label: str, setting: str) -> None:
    DROPIN.parent.mkdir(parents=True, exist_ok=True)
    DROPIN.write_text(f"[Service]\nEnvironment={setting}\n")
    run("systemctl", "daemon-reload")
    run("systemctl", "reset-failed", "cgpu-kmod.service")
    since = monotonic_usec()
    start = run("systemctl", "start", "cgpu-kmod.service")
    state = show("cgpu-kmod.service", "ActiveState", "Result")
    messages = journal("cgpu-kmod.service", since)
    node.check(f"kmod: with {label} the unit fails",
               start.returncode != 0 and state.get("ActiveState") == "failed",
               f"systemctl start status {start.returncode}, {state}")
    node.check(f"kmod: with {label} the module is not loaded", not TREE.exists(),
               "no /proc/cgpu_km" if not TREE.exists() else "/proc/cgpu_km exists")
    node.check(f"kmod: with {label} the journal says why",
               "cgpu_km not loaded" in messages,
               " | ".join(line for line in messages.splitlines() if "cgpu" in line)[:240])







# -- 7. the FUSE unit, once the module is gone ------------------------------------

def fuse_unit(node: Node) -> None:
    phase("fuse: cgpu-fuse.service without the module")
    start = run("systemctl", "start", "cgpu-fuse.service")
    try:
        wait_for("the FUSE tree", lambda: Path("/run/cgpu_km/1/policy").exists(), 30)
        gpus = sorted(p.name for p in Path("/run/cgpu_km").iterdir() if p.name.isdigit())
        node.check("fuse: cgpu-fuse.service serves /run/cgpu_km with NVML's 2 GPUs",
                   start.returncode == 0 and gpus == ["0", "1"], f"GPUs {' '.join(gpus)}")
    finally:
        run("systemctl", "stop", "cgpu-fuse.service")
    DROPIN_FUSE.parent.mkdir(parents=True, exist_ok=True)
    DROPIN_FUSE.write_text("[Service]\nEnvironment=SIMGPU_VISIBLE_DEVICES=\nRestart=no\n")
    run("systemctl", "daemon-reload")
    since = monotonic_usec()
    run("systemctl", "start", "cgpu-fuse.service")  # Type=simple: fails after it started
    with suppress(Abort):
        wait_for("cgpu-fuse.service fails", lambda: show(
            "cgpu-fuse.service", "ActiveState")["ActiveState"] == "failed", 30)
    state = show("cgpu-fuse.service", "ActiveState", "Result")
    messages = journal("cgpu-fuse.service", since)
    node.check("fuse: with no GPU the unit fails and says why",
               state.get("ActiveState") == "failed" and "not serving the tree" in messages,
               f"{state}, {one_line(messages, 'cgpu-fuse:')}")
    DROPIN_FUSE.unlink()
    run("systemctl", "daemon-reload")


def kernel_log(node: Node) -> None:
    log = run("dmesg").stdout
    problems = [line for line in log.splitlines()
                if re.search(r"BUG:|BUG [a-z0-9_-]+ \(|WARNING:|Oops|general protection", line)]
    node.check("kernel: no BUG, WARNING or Oops in the kernel log", not problems,
               " | ".join(problems[:3]) or f"{len(log.splitlines())} lines")




# --- main ----------------------------------------------------------------------

PHASES: tuple[Callable[[Node], None], ...] = (
    install, kmod, daemon_up, shares, limits, recovery, kmod_without_nvml, fuse_unit,
    kernel_log)


def phases_until() -> tuple[Callable[[Node], None], ...]:
    """PHASES, or those up to the one that `cgpu.until=NAME` on the kernel command line
    names (run.sh's NODE_VM_UNTIL: `shares` runs the install, the units and the shares)."""
    words = Path("/proc/cmdline").read_text().split()
    until = next((w.partition("=")[2] for w in words if w.startswith("cgpu.until=")), "")
    names = [phase.__name__ for phase in PHASES]
    if until not in names:
        return PHASES
    return PHASES[:names.index(until) + 1]


def dump_journal() -> None:
    say("CGPU-NODE: journal of the cgpu units")
    out = run("journalctl", "--no-pager", "-o", "short-monotonic", "-u", "cgpu-kmod",
              "-u", "cgpu-daemon", "-u", "cgpu-fuse").stdout
    for line in out.splitlines()[-150:]:
        say(f"# {line}")


@contextmanager
def timed(results: Results) -> Iterator[None]:
    started = uptime()
    try:
        yield
    finally:
        say(f"CGPU-NODE: checks took {uptime() - started:.1f} s; "
            f"{len(results.failed)} failed")


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        say("usage: checks.py REPO")
        return 2
    work = Path("/tmp/cgpu-node-test")
    work.mkdir(parents=True, exist_ok=True)
    node = Node(Path(argv[1]), work, Results())
    with timed(node.results):
        try:
            simgpu_devices(node)
            phases = phases_until()
            if phases != PHASES:
                say(f"CGPU-NODE: only the phases up to {phases[-1].__name__} (cgpu.until)")
            for index, step in enumerate(phases):
                try:
                    step(node)
                except Exception as error:  # a bug here fails the run too, with its reason
                    node.check(step.__name__, False, f"{type(error).__name__}: {error}")
                    left = [later.__name__ for later in phases[index + 1:]]
                    if left:
                        node.check("not run", False, " ".join(left))
                    break
        finally:
            node.cleanup()
    if node.results.failed:
        dump_journal()
    say(f"CGPU-NODE-RESULT: {'FAIL' if node.results.failed else 'PASS'}")
    return 1 if node.results.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
