"""A host under attack: simgpu, the FUSE tree, the real daemon and runc containers.

`Node` is one simulated host: a world-traversable folder (so that a host
user who is not root reaches the region folder itself, and it is the
region folder's own mode that stops them), a `SimHost` (simgpu state, region
folder, `cgpu-daemon`), and containers started by real runc with `cgpu-hook`
in their config.json, exactly as an operator configures it. Each container
gets its own copy of a busybox root filesystem that holds the attack
program (`attacker.c`) and `sharework`, simgpu's libraries where the image's
driver libraries would be, and `/out`, a folder shared with the host.

`Proc` drives one process inside a container (`runc exec`) line by line.
Nothing here reads a share from NVML or from the daemon: shares are counted
by `sharework` in the containers (`ShareJob`).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO

from cgpu_km.container.oci.spec import CREATE_RUNTIME
from cgpu_km.dataplane import kernelview
from cgpu_km.dataplane import region as region_mod
from cgpu_km.tree import client as treefs
from tests.bench.shares import Report, parse_report
from tests.daemon.simbox import SHAREWORK, SIMGPU, SimHost
from tests.libcgpu.test_runc_e2e import shared_libraries

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
LIBCGPU = REPO / "libcgpu" / "libcgpu.so"
VENV_BIN = Path(sys.executable).parent
HOOK = VENV_BIN / "cgpu-hook"
RUNC = shutil.which("runc")
BUSYBOX = shutil.which("busybox")
SETPRIV = shutil.which("setpriv")
MIB = 1 << 20
TOTAL = 15109 * MIB  # the simulated Tesla T4
NOBODY = 65534
GPU_LIBS = "/usr/lib/x86_64-linux-gnu"
APPLETS = ("sh", "cat", "dd", "id", "readlink", "sleep", "echo", "mv", "mkdir", "ls", "rm",
           "cp", "chmod", "printf", "grep", "head", "umount", "truncate", "touch", "stat",
           "date", "true", "unshare")
# Docker's default capabilities: what root in a container has (no CAP_SYS_ADMIN).
DOCKER_CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
               "CAP_NET_RAW", "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
               "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE"]


RAWLAUNCH = "/librawlaunch.so"  # `build_rawlaunch`'s library, where `image_with` puts it
RAW = {"LD_PRELOAD": RAWLAUNCH}  # with `image_with(rawlaunch)`: launches past the gate


def image_with(library: Path) -> Callable[[Path], None]:
    """An image step for `Node.container`: `library` copied to the image's root."""
    def image(rootfs: Path) -> None:
        shutil.copy2(library, rootfs / library.name)
    return image


def missing() -> str | None:
    """Why containers cannot be run here, or None."""
    if os.geteuid() != 0:
        return "runc, FUSE and setpriv need root"
    for tool, name in ((RUNC, "runc"), (BUSYBOX, "busybox (busybox-static)"),
                       (SETPRIV, "setpriv (util-linux)"), (shutil.which("nsenter"), "nsenter"),
                       (shutil.which("gcc"), "gcc")):
        if tool is None:
            return f"{name} is not installed"
    for path in (SIMGPU / "libcuda.so.1", SIMGPU / "libnvidia-ml.so.1", SHAREWORK, LIBCGPU):
        if not path.exists():
            return f"{path.relative_to(REPO)} is not built (make build)"
    return None


def build_attacker(out: Path) -> Path:
    """Compile attacker.c against simgpu's cuda.h and libcgpu's region.h."""
    binary = out / "attacker"
    subprocess.run(
        ["gcc", "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror",
         f"-I{REPO / 'libcgpu' / 'include'}", f"-I{REPO / 'libcgpu'}", "-o", str(binary),
         str(HERE / "attacker.c"), f"-L{SIMGPU}", "-lcuda", "-ldl"], check=True)
    return binary


def build_rawlaunch(out: Path) -> Path:
    """Compile rawlaunch.c: a preload that launches past libcgpu's gate."""
    library = out / RAWLAUNCH.lstrip("/")
    subprocess.run(["gcc", "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared",
                    "-fPIC", f"-I{REPO / 'libcgpu' / 'include'}", "-o", str(library),
                    str(HERE / "rawlaunch.c")], check=True)
    return library


def make_rootfs(root: Path, binaries: Sequence[Path]) -> None:
    """busybox and its applets, `binaries` at /, their libraries, simgpu's driver libraries."""
    for folder in ("bin", "proc", "dev", "sys", "etc", "run", "out", GPU_LIBS.lstrip("/")):
        (root / folder).mkdir(parents=True, exist_ok=True)
    (root / "tmp").mkdir(mode=0o1777)
    os.chmod(root / "tmp", 0o1777)
    assert BUSYBOX is not None
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    libs: set[Path] = set()
    for binary in binaries:
        shutil.copy2(binary, root / binary.name)
        libs.update(shared_libraries(binary))
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        libs.update(shared_libraries(SIMGPU / name))
        shutil.copy2(SIMGPU / name, root / GPU_LIBS.lstrip("/") / name)
    libs.update(shared_libraries(LIBCGPU))
    for lib in libs:
        if lib.resolve().parent == SIMGPU.resolve():
            continue  # simgpu's own are where a driver's would be (above)
        target = root / str(lib).lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib.resolve(), target)


def wait_for(predicate: Callable[[], object], timeout: float, what: str,
             step: float = 0.05) -> float:
    """Poll `predicate()` until true; seconds it took. AssertionError after `timeout`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(step)
    return time.monotonic() - start


def host_pid(pidns: int, inner: int) -> int | None:
    """The host pid of the process `inner` of pid namespace `pidns` (an inode), if it runs."""
    with os.scandir("/proc") as entries:
        pids = [entry.name for entry in entries if entry.name.isdigit()]
    for pid in pids:
        try:
            if os.stat(f"/proc/{pid}/ns/pid").st_ino != pidns:
                continue
            status = kernelview.read_proc(f"/proc/{pid}/status")  # names may be any bytes
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:") and int(line.split()[-1]) == inner:
                return int(pid)
    return None


def fields(line: str) -> dict[str, str]:
    """`key=value` words of one answer line."""
    return dict(word.split("=", 1) for word in line.split() if "=" in word)


class Proc:
    """One process in a container (`runc exec`), driven one command line at a time."""

    def __init__(self, popen: subprocess.Popen[bytes], pidns: int, log: Path) -> None:
        self.popen = popen
        self.pidns = pidns
        self.log = log
        self._buffer = b""
        self.pid = 0  # in the container
        self.host_pid = 0

    def send(self, command: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(f"{command}\n".encode())
        self.popen.stdin.flush()

    def read_line(self, timeout: float) -> str | None:
        """The next line of output, or None when none came within `timeout` (or at EOF)."""
        assert self.popen.stdout is not None
        fd = self.popen.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode(errors="replace")

    def ask(self, command: str, timeout: float = 15) -> str:
        """Send one command and return its one-line answer."""
        self.send(command)
        line = self.read_line(timeout)
        if line is None:
            raise AssertionError(f"no answer to {command!r} (exit status {self.popen.poll()}): "
                                 f"{self.stderr()}")
        if line.split()[:1] != command.split()[:1]:
            raise AssertionError(f"{command!r} answered {line!r}")
        return line

    def start(self) -> Proc:
        """`ready`: learn its pid inside and on the host."""
        answer = fields(self.ask("ready"))
        self.pid = int(answer["pid"])
        found = host_pid(self.pidns, self.pid)
        assert found is not None, "the process is not visible on the host"
        self.host_pid = found
        return self

    def unread(self) -> bytes:
        """Output read from the pipe but not returned as a line yet."""
        return self._buffer

    def stderr(self) -> str:
        """What `runc exec` and the process wrote on stderr (libcgpu's messages too)."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait(self, timeout: float) -> int | None:
        """Its exit status (runc exec: 128+N when signal N ended it), None if still running."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def alive(self) -> bool:
        return self.popen.poll() is None

    def close(self) -> None:
        """Kill the process and its `runc exec`, and reap `runc exec` for at most 10 s.

        Each is killed whether or not the other is gone: the process may have
        died under a test while `runc exec` still runs. Nothing reads the pipes
        to their end, for a child that `runc exec` forked (a vfork child among
        them) may hold them open past its exit; `runc delete --force` ends
        whatever is left of the container."""
        if self.host_pid and host_pid(self.pidns, self.pid) == self.host_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.host_pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)


@dataclass
class Container:
    """A running runc container with the hook, and what the test knows of it."""

    node: Node
    id: str
    bundle: Path
    rootfs: Path
    out: Path
    user: int
    procs: list[Proc] = field(default_factory=list)

    @property
    def id12(self) -> str:
        return self.id[:12]

    @property
    def region_path(self) -> Path:
        return region_mod.region_path(self.id12, self.node.region_dir)

    def region(self) -> region_mod.Region:
        """The region as the daemon maps it (on the host, as root)."""
        return region_mod.Region.open(self.region_path)

    def init_pid(self) -> int:
        assert RUNC is not None
        state = subprocess.run([RUNC, "state", self.id], capture_output=True, text=True,
                               timeout=30, check=True)
        return int(json.loads(state.stdout)["pid"])

    def pidns(self) -> int:
        return os.stat(f"/proc/{self.init_pid()}/ns/pid").st_ino

    def exec_args(self, args: Sequence[str], *, user: int | None = None,
                  env: Mapping[str, str] | None = None) -> list[str]:
        assert RUNC is not None
        command = [RUNC, "exec"]
        if user is not None:
            command += ["--user", f"{user}:{user}"]
        for key, value in (env or {}).items():
            command += ["--env", f"{key}={value}"]
        return [*command, self.id, *args]

    def proc(self, *, user: int | None = None, env: Mapping[str, str] | None = None,
             args: Sequence[str] = ("/attacker",)) -> Proc:
        """A new process in the container reading commands on stdin (started: `ready`)."""
        log = self.node.log_path(f"{self.id12}-exec")
        with log.open("ab") as stderr:
            popen = subprocess.Popen(self.exec_args(args, user=user, env=env),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
        proc = Proc(popen, self.pidns(), log)
        self.procs.append(proc)
        return proc.start()

    def sh(self, script: str, *, user: int | None = None,
           env: Mapping[str, str] | None = None, timeout: float = 30) -> str:
        """Run a shell script in the container; its stdout and stderr together."""
        result = subprocess.run(self.exec_args(["/bin/sh", "-c", script], user=user, env=env),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, timeout=timeout)
        return result.stdout

    def run(self, *commands: str, user: int | None = None,
            env: Mapping[str, str] | None = None) -> list[str]:
        """A fresh attacker process that runs `commands` and exits: its answer lines."""
        args = self.exec_args(["/attacker", *commands], user=user, env=env)
        result = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=60)
        lines = result.stdout.splitlines()
        assert len(lines) == len(commands), (result.returncode, lines, result.stderr)
        return lines


class ShareJob:
    """`sharework --go-stdin` in a container: the kernels it completes, per bucket."""

    def __init__(self, container: Container, us: int, seconds: float, *,
                 env: Mapping[str, str] | None = None) -> None:
        self.name = container.id12
        args = container.exec_args(["/sharework", "--us", str(us), "--seconds", str(seconds),
                                    "--go-stdin"], env=env)
        log = container.node.log_path(f"{self.name}-share")
        with log.open("ab") as stderr:
            self.popen = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=stderr)
        self.proc = Proc(self.popen, container.pidns(), log)
        container.procs.append(self.proc)

    def wait_ready(self, timeout: float = 30) -> None:
        line = self.proc.read_line(timeout)
        assert line is not None, "sharework exited before it was ready"
        assert line.startswith("ready"), f"sharework: {line!r}"

    def go(self, at: float) -> None:
        self.proc.send(f"go {at:.9f}")

    def report(self, timeout: float) -> Report:
        assert self.popen.stdout is not None
        out, _ = self.popen.communicate(timeout=timeout)
        assert self.popen.returncode == 0, f"sharework in {self.name}: {self.popen.returncode}"
        return parse_report((self.proc.unread() + out).decode())


@contextlib.contextmanager
def sharing(jobs: Sequence[ShareJob], delay: float = 0.5) -> Iterator[float]:
    """Start every job on one clock `delay` ahead; yields that start (CLOCK_MONOTONIC s)."""
    for job in jobs:
        job.wait_ready()
    t0 = time.monotonic() + delay
    for job in jobs:
        job.go(t0)
    yield t0


class Node:
    """One simulated host: simgpu, the tree at `tree`, the daemon, runc containers."""

    def __init__(self, base: Path, tree: Path, rootfs: Path, *,
                 context_mem: str = "0") -> None:
        self.base = base
        self.tree = tree
        self.base_rootfs = rootfs
        self.library = base / "lib" / "libcgpu.so"  # the host's copy that containers get
        self.library.parent.mkdir()
        shutil.copy2(LIBCGPU, self.library)
        self.sim = SimHost(base, tree, gpus=1, env={
            "SIMGPU_CONTEXT_MEM": context_mem, "CGPU_LIBCGPU": str(self.library)})
        self.context_mem = context_mem
        self.start = CREATE_RUNTIME  # the hook stage that registers its containers
        self.containers: list[Container] = []
        self._probe: tuple[Container, Proc] | None = None
        self.nvml_processes()  # creates simgpu's state file, which containers bind-mount

    @property
    def env(self) -> dict[str, str]:
        return self.sim.env

    @property
    def region_dir(self) -> Path:
        return self.sim.region_dir

    @property
    def state_dir(self) -> Path:
        return self.sim.state_dir

    def log_path(self, name: str) -> Path:
        return self.base / f"{name}.log"

    @contextlib.contextmanager
    def log_file(self, name: str) -> Iterator[IO[bytes]]:
        """A log of this node, open for a child to inherit."""
        with self.log_path(name).open("ab") as log:
            yield log

    def echo(self, relpath: str, value: int) -> None:
        """`echo VALUE > TREE/relpath`, as the operator does."""
        self.sim.echo(relpath, value)

    def start_daemon(self, *extra: str) -> None:
        """The real `cgpu-daemon` (`extra`: more of its options)."""
        self.sim.start_daemon(0.02, *extra)

    def daemon_alive(self) -> bool:
        return self.sim.daemon is not None and self.sim.daemon.poll() is None

    def meminfo(self, container: Container) -> tuple[int, dict[int, int]]:
        """(Free, {host pid: bytes}) from the container's meminfo node in the tree."""
        text = (self.tree / "0" / container.id12 / "meminfo").read_text()
        free, procs = 0, {}
        for line in text.splitlines():
            words = line.split()
            if words[:1] == ["Free:"]:
                free = int(words[1])
            elif words[:1] == ["PID:"]:
                procs[int(words[1])] = int(words[3])
        return free, procs

    def backstop_rounds(self, count: int) -> None:
        """Return once the daemon's memory service has run `count` more rounds.

        A round reads GPU memory, runs the backstop over what it read, then feeds
        meminfo. Before each round is awaited a probe container's process grows by
        one byte, so its meminfo showing the new size means a whole round, the
        backstop's decisions (and their log lines) included, ran on a view taken
        after everything that happened before the call: a round counter, not a sleep.
        """
        if self._probe is None:
            probe = self.container({"ALIYUN_COM_GPU_MEM_CONTAINER": "1024",
                                    "ALIYUN_COM_GPU_MEM_DEV": "15109"})
            self._probe = probe, probe.proc()
        container, proc = self._probe

        def grown(before: int | None) -> bool:
            return self.meminfo(container)[1].get(proc.host_pid) not in (None, before)

        for _ in range(count):
            before = self.meminfo(container)[1].get(proc.host_pid)
            assert proc.ask("alloc 1") == "alloc rc=0"
            wait_for(partial(grown, before), 30, "a round of the daemon's memory service")

    def nvml_processes(self) -> dict[int, int]:
        """simgpu's own per-process accounting, through NVML (host pids -> bytes)."""
        script = ("import json, pynvml\nfrom cgpu_km.gpus import load_simgpu\nload_simgpu()\n"
                  "pynvml.nvmlInit()\nh = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
                  "print(json.dumps({p.pid: p.usedGpuMemory for p in "
                  "pynvml.nvmlDeviceGetComputeRunningProcesses(h)}))\n")
        out = subprocess.run([sys.executable, "-c", script], env=self.env, capture_output=True,
                             text=True, timeout=30, check=True).stdout
        return {int(pid): int(size) for pid, size in json.loads(out).items()}

    def hook_env(self) -> list[str]:
        keep = ("CGPU_SIMULATE", "CGPU_SIMGPU_DIR", "CGPU_REGION_DIR", "CGPU_LIBCGPU",
                "SIMGPU_DEVICES", "SIMGPU_STATE", "SIMGPU_CONTEXT_MEM")
        return [f"PATH={os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}",
                *(f"{key}={self.env[key]}" for key in keep)]

    def container(self, env: Mapping[str, str], *, user: int = NOBODY,
                  files: Mapping[str, str] | None = None,
                  image: Callable[[Path], None] | None = None,
                  mounts: Sequence[Mapping[str, object]] = (),
                  seccomp: Mapping[str, object] | None = None) -> Container:
        """Start a container (`runc run --detach`, init `sleep`) with the hook and `env`;
        `files` are written into its rootfs first (path -> text, executable), then
        `image(rootfs)` edits it further (links, folders: what an image may hold);
        `mounts` are added to its config's; `seccomp` is its config's `linux.seccomp`."""
        container, code, errors = self.try_container(env, user=user, files=files, image=image,
                                                     mounts=mounts, seccomp=seccomp)
        assert code == 0, f"runc run failed: {errors}"
        return container

    def try_container(self, env: Mapping[str, str], *, user: int = NOBODY,
                      files: Mapping[str, str] | None = None,
                      image: Callable[[Path], None] | None = None,
                      mounts: Sequence[Mapping[str, object]] = (),
                      seccomp: Mapping[str, object] | None = None,
                      rootfs_of: Container | None = None
                      ) -> tuple[Container, int, str]:
        """As `container`, but the start may fail: (container, runc's status, its stderr).
        With `rootfs_of`, it runs on that container's root filesystem, not a copy."""
        container_id = uuid.uuid4().hex
        bundle = self.base / container_id
        rootfs, out = bundle / "rootfs", bundle / "out"
        bundle.mkdir()
        if rootfs_of is None:
            subprocess.run(["cp", "-a", str(self.base_rootfs), str(rootfs)], check=True)
        else:
            rootfs = rootfs_of.rootfs
        out.mkdir(parents=True)
        out.chmod(0o777)
        for path, text in (files or {}).items():
            target = rootfs / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            target.chmod(0o755)
        if image is not None:
            image(rootfs)
        config = self._config(bundle, env, user)
        config["root"] = {"path": str(rootfs), "readonly": False}
        config_mounts = config["mounts"]
        assert isinstance(config_mounts, list)
        config_mounts += [dict(mount) for mount in mounts]
        if seccomp is not None:
            linux = config["linux"]
            assert isinstance(linux, dict)
            linux["seccomp"] = dict(seccomp)
        (bundle / "config.json").write_text(json.dumps(config))
        container = Container(self, container_id, bundle, rootfs, out, user)
        self.containers.append(container)
        assert RUNC is not None
        errors = bundle / "runc.err"
        with self.log_file("runc") as log, errors.open("wb") as stderr:
            # Files, not pipes: the detached container keeps runc's stdio open.
            code = subprocess.run([RUNC, "run", "--detach", "--bundle", str(bundle),
                                   container_id], stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=stderr, timeout=120).returncode
        return container, code, errors.read_text()

    def _config(self, bundle: Path, env: Mapping[str, str], user: int) -> dict[str, object]:
        assert RUNC is not None
        subprocess.run([RUNC, "spec", "--bundle", str(bundle)], check=True, timeout=30)
        config: dict[str, object] = json.loads((bundle / "config.json").read_text())
        caps = {"bounding": DOCKER_CAPS, "effective": DOCKER_CAPS if user == 0 else [],
                "permitted": DOCKER_CAPS if user == 0 else [], "inheritable": [],
                "ambient": []}
        config["root"] = {"path": "rootfs", "readonly": False}
        config["process"] = {
            "terminal": False, "user": {"uid": user, "gid": user}, "cwd": "/",
            "args": ["/bin/sleep", "600"], "capabilities": caps,
            "env": ["PATH=/bin", f"LD_LIBRARY_PATH={GPU_LIBS}",
                    f"SIMGPU_DEVICES={self.env['SIMGPU_DEVICES']}", "SIMGPU_STATE=/simgpu-state",
                    f"SIMGPU_CONTEXT_MEM={self.context_mem}", "NVIDIA_VISIBLE_DEVICES=0",
                    *(f"{k}={v}" for k, v in env.items())],
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
        }
        mounts = config["mounts"]
        assert isinstance(mounts, list)
        mounts += [
            {"destination": "/simgpu-state", "type": "bind", "source": self.env["SIMGPU_STATE"],
             "options": ["bind", "rw"]},
            {"destination": "/out", "type": "bind", "source": str(bundle / "out"),
             "options": ["bind", "rw"]},
        ]
        config["hooks"] = {
            stage: [{"path": str(HOOK), "args": ["cgpu-hook", "--root", str(self.tree), stage],
                     "env": self.hook_env(), "timeout": 60}]
            for stage in (self.start, "poststop")
        }
        return config

    def cgpu_run(self, name: str, command: Sequence[str], *extra: str) -> subprocess.Popen[bytes]:
        """A host job: `cgpu-run --name NAME [extra] -- COMMAND`, as root."""
        args = [str(VENV_BIN / "cgpu-run"), "--root", str(self.tree), "--name", name, *extra,
                "--", *command]
        with self.log_file(name) as log:
            process = subprocess.Popen(args, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.sim.containers[name] = process
        return process

    def close(self) -> None:
        for container in self.containers:
            for proc in container.procs:
                proc.close()
            assert RUNC is not None
            subprocess.run([RUNC, "delete", "--force", container.id], capture_output=True,
                           timeout=60, check=False)
        self.sim.close()


def reset_tree(tree: Path) -> None:
    """Put GPU 0 of a shared tree back as a test found it: no containers, the defaults."""
    gpu = treefs.read_tree(tree).gpus[0]
    for name in gpu.containers:
        with contextlib.suppress(OSError):
            treefs.inst_ctl(tree, f"del {name}")
    for node, value in (("0/policy", 1), ("0/max_inst", 16), ("0/prio_ratio", 80),
                        ("default_memsize", 0)):
        (tree / node).write_text(f"{value}\n")


@contextlib.contextmanager
def built_node(tree: Path, rootfs: Path, context_mem: str = "0") -> Iterator[Node]:
    """A host on `tree` (`context_mem`: simgpu's context size), torn down after use.

    Its folder is world-traversable, unlike pytest's own, so that what stops a
    host user who is not root is the region folder's own mode."""
    folder = Path(tempfile.mkdtemp(prefix="cgpu-attack-"))
    try:
        folder.chmod(0o755)
        node = Node(folder, tree, rootfs, context_mem=context_mem)
        try:
            yield node
        finally:
            node.close()
            reset_tree(tree)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def bench_site(prefix: str) -> Iterator[tuple[Path, Path, Path]]:
    """For a benchmark of runc containers: a world-traversable folder, a root
    filesystem with the attack program and sharework, and one mounted tree (1 GPU);
    yields (folder, rootfs, tree root), and removes them all after use."""
    from tests.conftest import MountedTree

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        folder.chmod(0o755)
        rootfs = folder / "rootfs"
        make_rootfs(rootfs, [build_attacker(folder), SHAREWORK])
        tree = MountedTree(folder / "tree" / "cgpu_km", 1)
        try:
            yield folder, rootfs, tree.root
        finally:
            tree.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
