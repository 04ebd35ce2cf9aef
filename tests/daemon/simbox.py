"""A whole host on simgpu for measured tests and the benchmark.

A private simgpu state, region folder and daemon state folder; the real
`cgpu-daemon` on a control tree (given, or mounted with `fuse_tree`); and
containers started the way a user starts them, with `cgpu-run`. Nothing
here creates a region or reads the GPU's meters: what a container got is
counted by its workload (`tests.bench.shares`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

from cgpu_km.children import stop_child

REPO = Path(__file__).resolve().parents[2]
SIMGPU = REPO / "simgpu"
LIBCGPU = REPO / "libcgpu" / "libcgpu.so"
SHAREWORK = SIMGPU / "sharework"
UUID = "GPU-5e1f3a2b-0c4d-4e6f-8a9b-7c1d2e3f4a5b"
VENV_BIN = Path(sys.executable).parent


def share_options(weight: int | None, highprio: bool, util_limit: int | None) -> list[str]:
    """`cgpu-run`'s options for a container's compute share."""
    options = [] if weight is None else ["--weight", str(weight)]
    if highprio:
        options.append("--highprio")
    if util_limit is not None:
        options += ["--util-limit", str(util_limit)]
    return options


def stop_job(process: subprocess.Popen[bytes], timeout: float = 15) -> None:
    """SIGTERM to a `cgpu-run` (it forwards it and cleans up), SIGKILL to its
    process group after `timeout`; then close the pipes it was given."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


def missing() -> str | None:
    """Why a simulated host cannot run here, or None."""
    for path in (SIMGPU / "libcuda.so.1", SIMGPU / "libnvidia-ml.so.1", SHAREWORK, LIBCGPU):
        if not path.exists():
            return f"{path.relative_to(REPO)} is not built (make build)"
    return None


@contextlib.contextmanager
def fuse_tree(base: Path, gpus: int) -> Iterator[Path]:
    """Mount `cgpu-fuse` at `base/tree` for the duration; yields the root."""
    root = base / "tree"
    root.mkdir(parents=True)
    with (base / "fuse.log").open("wb") as log:
        process = subprocess.Popen(
            [str(VENV_BIN / "cgpu-fuse"), "--root", str(root), "--gpus", str(gpus)],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not os.path.ismount(root):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cgpu-fuse did not mount: {(base / 'fuse.log').read_text()}")
            time.sleep(0.05)
        yield root
    finally:
        subprocess.run(["fusermount", "-u", "-z", str(root)], check=False)
        stop_child(process, 10, signum=None)


class SimHost:
    """`gpus` simulated T4s, the daemon, and `cgpu-run` containers on the tree at `root`.

    `env` is added to every process's environment (None removes a variable);
    SIMGPU_* variables of this process (e.g. SIMGPU_SCHED) pass through
    unless `env` sets them.
    """

    sharework = SHAREWORK

    def __init__(self, tmp: Path, root: Path, *, gpus: int = 1,
                 env: Mapping[str, str | None] | None = None) -> None:
        self.tmp = tmp
        self.root = root
        self.region_dir = tmp / "regions"
        self.state_dir = tmp / "daemon"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.daemon: subprocess.Popen[bytes] | None = None
        self.containers: dict[str, subprocess.Popen[bytes]] = {}
        devices = ",".join(f"Tesla T4:15109MiB:{self.uuid(i)}" for i in range(gpus))
        own = {
            **{k: v for k, v in os.environ.items() if k.startswith("SIMGPU_")},
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LD_LIBRARY_PATH": str(SIMGPU),
            "SIMGPU_STATE": str(tmp / "simgpu-state"),
            "SIMGPU_DEVICES": devices,
            "SIMGPU_CONTEXT_MEM": "0",
            "CGPU_SIMULATE": "1",
            "CGPU_SIMGPU_DIR": str(SIMGPU),
            "CGPU_REGION_DIR": str(self.region_dir),
            "PYTHONPATH": str(REPO),
            **(env or {}),
        }
        self.env = {k: v for k, v in own.items() if v is not None}

    @staticmethod
    def uuid(gpu: int) -> str:
        return f"{UUID[:-2]}{gpu:02d}"

    def echo(self, relpath: str, value: int) -> None:
        """`echo VALUE > TREE/relpath`."""
        (self.root / relpath).write_text(f"{value}\n")

    # -- the daemon --

    def start_daemon(self, period: float = 0.02, *extra: str) -> None:
        """Start `cgpu-daemon` and wait until it has published its first snapshot."""
        (self.state_dir / "snapshot.json").unlink(missing_ok=True)
        with (self.tmp / "daemon.log").open("ab") as log:
            self.daemon = subprocess.Popen(
                [str(VENV_BIN / "cgpu-daemon"), "--root", str(self.root), "--state-dir",
                 str(self.state_dir), "--region-dir", str(self.region_dir), "--period",
                 str(period), *extra],
                env=self.env, stdout=log, stderr=log,
            )
        deadline = time.monotonic() + 30
        while not (self.state_dir / "snapshot.json").exists():
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cgpu-daemon did not start: {self.daemon_log()}")
            time.sleep(0.05)

    def daemon_log(self) -> str:
        path = self.tmp / "daemon.log"
        return path.read_text() if path.exists() else ""

    def kill_daemon(self, sig: int = signal.SIGKILL) -> None:
        if self.daemon is not None:
            self.daemon.send_signal(sig)
            self.daemon.wait(timeout=30)
            self.daemon = None

    def daemon_cpu_seconds(self) -> float:
        """user+system CPU time the running daemon has used so far."""
        assert self.daemon is not None
        fields = Path(f"/proc/{self.daemon.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    # -- containers --

    def cgpu_run(self, name: str, command: list[str], *, gpu: int = 0,
                 weight: int | None = None, highprio: bool = False,
                 util_limit: int | None = None, stdin: int | IO[bytes] | None = None,
                 stdout: int | IO[bytes] | None = None) -> subprocess.Popen[bytes]:
        """`cgpu-run --name NAME --gpu G [...] -- COMMAND`, in its own process group."""
        args = [str(VENV_BIN / "cgpu-run"), "--root", str(self.root), "--name", name,
                "--gpu", str(gpu), *share_options(weight, highprio, util_limit)]
        with (self.tmp / f"{name}.log").open("ab") as log:
            process = subprocess.Popen([*args, "--", *command], env=self.env, stdin=stdin,
                                       stdout=stdout if stdout is not None else log,
                                       stderr=log, start_new_session=True)
        self.containers[name] = process
        return process

    def idle(self, name: str, gpu: int = 0, *, weight: int | None = None) -> None:
        """A registered container that runs nothing on the GPU."""
        self.cgpu_run(name, ["sleep", "86400"], gpu=gpu, weight=weight)
        self.wait_registered(name, gpu)

    def wait_registered(self, name: str, gpu: int = 0, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not (self.root / str(gpu) / name / "weight").exists():
            process = self.containers.get(name)
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"cgpu-run {name} exited: {self.log(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} was not registered on GPU {gpu} in {timeout} s")
            time.sleep(0.02)

    def wait_unregistered(self, name: str, gpu: int = 0, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while (self.root / str(gpu) / name).exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} was still registered on GPU {gpu} after {timeout} s")
            time.sleep(0.02)

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, name: str, timeout: float = 15) -> None:
        """SIGTERM to `cgpu-run` (it forwards it and cleans up); SIGKILL to its group after."""
        process = self.containers.pop(name, None)
        if process is not None:
            stop_job(process, timeout)

    def close(self) -> None:
        for name in list(self.containers):
            self.stop(name)
        if self.daemon is not None and self.daemon.poll() is None:
            self.kill_daemon(signal.SIGTERM)


def held_at(share: float, cap: float) -> bool:
    """Whether a capped share is at its cap: never more than 3 points above it (the
    scheduler's error), and at most 7 below (time this loaded two-core host's stalls take
    from the workload's own process, which only ever lowers what it completes)."""
    return cap - 0.07 <= share <= cap + 0.03
