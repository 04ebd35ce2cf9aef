"""`cgpu-run`: run a command as a transient managed container on a bare host.

    cgpu-run [--gpu LIST] [--memsize BYTES] [--weight W] [--highprio]
             [--util-limit P] [--egpu [--oom-script PATH]] -- CMD ...

It registers the container on each GPU in the control tree, creates its
region (gates closed until the daemon's first grant), runs CMD with libcgpu
preloaded (LD_PRELOAD, CGPU_REGION, CUDA_VISIBLE_DEVICES; on simgpu its
libraries first on LD_LIBRARY_PATH) in a pid namespace
of its own when it runs as root (`unshare`; the namespace is the job's
identity, which its processes cannot leave: the daemon uses it to tell the
job's GPU processes from others), records that identity next to the region,
forwards signals to the job, and on any exit removes the region and the
container. The exit status is CMD's (128+N for signal N).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType

from cgpu_km import gpus as gpus_mod
from cgpu_km import paths
from cgpu_km.dataplane import kernelview
from cgpu_km.dataplane import region as region_mod
from cgpu_km.tree import client as treefs

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
PR_SET_PDEATHSIG = 1


class RunError(Exception):
    """A bad argument or a setup failure; `str(error)` is the one-line message."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _gpu_list(text: str) -> list[int]:
    try:
        indexes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of GPU indexes: {text!r}") from None
    if any(i < 0 for i in indexes) or len(set(indexes)) != len(indexes):
        raise argparse.ArgumentTypeError(f"GPU indexes must be distinct and >= 0: {text!r}")
    return indexes


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="cgpu-run", description="Run CMD as a transient container with GPU limits.")
    parser.add_argument("--root", help="control tree (default: $CGPU_KM_ROOT, /proc/cgpu_km, "
                        "/run/cgpu_km)")
    parser.add_argument("--gpu", type=_gpu_list, default=[0], help="host GPU indexes, e.g. 0,2")
    parser.add_argument("--memsize", type=_positive, help="memory limit in bytes on each GPU")
    parser.add_argument("--weight", type=int, help="compute weight (tree default 1)")
    parser.add_argument("--highprio", action="store_true", help="high priority")
    parser.add_argument("--util-limit", type=int, help="eGPU: at most P percent of GPU time")
    parser.add_argument("--egpu", action="store_true", help="eGPU mode: over-limit "
                        "allocations run the OOM script and stop the process")
    parser.add_argument("--oom-script", default="", help="eGPU: program to run before stopping")
    parser.add_argument("--name", help="container id (default: run-<pid>)")
    parser.add_argument("--ctx-bytes", type=int, help="bytes charged per process context")
    parser.add_argument("--no-tree", action="store_true",
                        help="do not register in the control tree (region and library only)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given (cgpu-run [options] -- CMD ...)")
    return args


@dataclass(frozen=True)
class Setup:
    name: str
    root: Path | None
    region_path: Path
    env: dict[str, str]
    scheduled: bool  # a daemon schedules it (else its gates start open)


def _add_command(gpu: int, name: str, args: argparse.Namespace) -> str:
    parts = [f"add {gpu} {name}"]
    if args.memsize is not None:
        parts.append(f"memsize={args.memsize}")
    if args.weight is not None:
        parts.append(f"weight={args.weight}")
    if args.highprio:
        parts.append("highprio=1")
    if args.util_limit is not None:
        parts.append(f"util_limit={args.util_limit}")
    return " ".join(parts)


def _register(root: Path, name: str, args: argparse.Namespace) -> list[int]:
    """Add the container on every GPU; on failure undo and raise RunError."""
    added: list[int] = []
    for gpu in args.gpu:
        try:
            treefs.inst_ctl(root, _add_command(gpu, name, args))
        except OSError as error:
            for done in added:
                with contextlib.suppress(OSError):
                    treefs.inst_ctl(root, f"del {done} {name}")
            raise RunError(f"cannot register {name} on GPU {gpu} in {root}: "
                           f"{error.strerror or error}") from None
        added.append(gpu)
    return added


def _limit(root: Path | None, gpu: gpus_mod.GpuInfo, name: str,
           memsize: int | None) -> int:
    if memsize is not None:
        return memsize
    if root is not None:
        value = treefs.read_int(root / str(gpu.index) / name / "memsize")
        if value > 0:
            return value
    return gpu.memory_total


@contextlib.contextmanager
def managed(args: argparse.Namespace) -> Iterator[Setup]:
    """Register, create the region, yield the child's environment; always clean up."""
    library = paths.libcgpu()
    if not library.is_file():
        raise RunError(f"{library} not found: build it with `make -C libcgpu` "
                       f"or set {paths.LIBCGPU_ENV}")
    name = args.name or f"run-{os.getpid()}"
    if not NAME_RE.match(name):
        raise RunError(f"bad container id {name!r}: 1 to 64 of [A-Za-z0-9_.-]")
    try:
        host_gpus = gpus_mod.discover_gpus()
    except gpus_mod.GpuError as error:
        raise RunError(str(error)) from None
    by_index = {g.index: g for g in host_gpus}
    unknown = [i for i in args.gpu if i not in by_index]
    if unknown:
        raise RunError(f"--gpu: no GPU {unknown[0]} on this host ({len(host_gpus)} GPUs)")
    if args.oom_script and not args.egpu:
        raise RunError("--oom-script needs --egpu")
    try:
        ctx_bytes = (args.ctx_bytes if args.ctx_bytes is not None
                     else region_mod.default_ctx_bytes())
    except region_mod.RegionError as error:
        raise RunError(str(error)) from None

    root = None if args.no_tree else treefs.resolve_root(args.root)
    if root is not None and not treefs.serves(root):
        raise RunError(f"no control tree at {root} (start cgpu-fuse or load cgpu_km.ko, "
                       f"or pass --no-tree)")
    added = _register(root, name, args) if root is not None else []
    path = region_mod.region_path(name)
    try:
        specs = [region_mod.GpuSpec(limit=_limit(root, by_index[i], name, args.memsize),
                                    uuid=by_index[i].uuid, host_index=i, ctx_bytes=ctx_bytes)
                 for i in args.gpu]
        try:
            region_mod.Region.create(path, name, specs, mode="egpu" if args.egpu else "cgpu",
                                     oom_script=args.oom_script,
                                     gates_open=root is None).close()
        except (region_mod.RegionError, OSError) as error:
            raise RunError(f"cannot create the region {path}: {error}") from None
        env = dict(os.environ)
        preload = env.get("LD_PRELOAD", "")
        env["LD_PRELOAD"] = f"{library}:{preload}" if preload else str(library)
        env[region_mod.REGION_ENV] = str(path)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(by_index[i].uuid for i in args.gpu)
        if gpus_mod.simulating():
            env = gpus_mod.with_simgpu_libraries(env, gpus_mod.simgpu_lib_dir())
        if args.egpu and args.oom_script:
            env["ALIYUN_COM_GPU_OOM_SCRIPT"] = args.oom_script
        yield Setup(name=name, root=root, region_path=path, env=env, scheduled=root is not None)
    finally:
        region_mod.Region.remove(path)
        if root is not None:
            for gpu in added:
                with contextlib.suppress(OSError):
                    treefs.inst_ctl(root, f"del {gpu} {name}")


def own_namespace_prefix() -> list[str]:
    """`unshare` into a pid namespace (and a /proc) of the job's own, when this
    process may (root), with `cgpu_km.container.jobinit` as the namespace's first process."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        return []
    return [unshare, "--pid", "--fork", "--kill-child", "--mount-proc", "--",
            sys.executable, "-m", "cgpu_km.container.jobinit", "--"]


def job_pid(child: subprocess.Popen[bytes], namespaced: bool, timeout: float = 5.0) -> int:
    """The host pid of the job: `unshare`'s child when it made a namespace."""
    if not namespaced:
        return child.pid
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and child.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            found = Path(f"/proc/{child.pid}/task/{child.pid}/children").read_text().split()
            if found:
                return int(found[0])
        time.sleep(0.001)
    return child.pid


class Interrupted(Exception):
    """A forwarded signal came before the job ran: set-up stops and is undone."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    for sig in FORWARDED:  # the undoing is not interrupted in turn
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


def _child_setup(parent: int, namespaced: bool) -> None:
    """In the forked child, before exec: die with cgpu-run (a job must not
    outlive the container it was registered as), and take the signals again,
    unless jobinit will: signals sent to a namespace's init before it has
    handlers are dropped, blocked ones wait."""
    if not namespaced:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # cgpu-run died before prctl
        os._exit(1)


def run_child(command: list[str], env: dict[str, str], region: Path | None = None) -> int:
    """Run the command (in a pid namespace of its own when root), record its
    identity in `region`, forward signals to it; its exit status (128+N when
    killed by N). Signals that come while it starts wait until they can be
    forwarded; those that come after it ended are ignored (cleanup runs)."""
    prefix = own_namespace_prefix()
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        try:
            child = subprocess.Popen([*prefix, *command], env=env,
                                     preexec_fn=partial(_child_setup, os.getpid(), bool(prefix)))
        except OSError as error:
            raise RunError(f"cannot run {command[0]}: {error.strerror or error}") from None
        job = job_pid(child, bool(prefix))

        def forward(signum: int, _frame: FrameType | None) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(job, signum)

        for sig in FORWARDED:
            signal.signal(sig, forward)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    try:
        if region is not None and prefix:
            # Its pid namespace only: its cgroups are whoever started cgpu-run's.
            owner = kernelview.owner_of(job, cgroups=False)
            if owner is not None:
                with contextlib.suppress(OSError):
                    kernelview.write_owner(region, owner)
        while True:
            try:
                status = child.wait()
                break
            except InterruptedError:
                continue
    finally:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_IGN)
    return 128 - status if status < 0 else status


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    for sig in FORWARDED:
        signal.signal(sig, _interrupt)
    try:
        with managed(args) as setup:
            return run_child(args.command, setup.env, setup.region_path)
    except RunError as error:
        print(f"cgpu-run: {error}", file=sys.stderr)
        return 2
    except Interrupted as interrupted:
        print(f"cgpu-run: {interrupted} before the job started: nothing left behind",
              file=sys.stderr)
        return 128 + interrupted.signum


if __name__ == "__main__":
    sys.exit(main())
