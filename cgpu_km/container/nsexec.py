"""Run a program inside a container, as one of its processes runs: never on the host.

    python -m cgpu_km.container.nsexec --pid HOSTPID [--timeout S] [--env K=V ...] \
        -- PROGRAM [ARG ...]

The daemon uses it for the eGPU OOM script, a path the container chose. This
process (a fresh, single-threaded interpreter started by the daemon as
root) opens the namespaces of HOSTPID, joins its cgroups, then enters its
user, mount, UTS, IPC, network, cgroup and pid namespaces, gives up every
capability outside HOSTPID's bounding set, takes HOSTPID's uid, gid and
groups, sets no_new_privs, and forks: the child (in the container's pid
namespace) executes PROGRAM as resolved in the container's file system.
It is killed after the timeout. Exit status: PROGRAM's, 124 on timeout,
125 when the container could not be entered (one line on stderr says why).

Not applied: the container's seccomp filter and LSM profile (AppArmor,
SELinux), which only its runtime knows.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from cgpu_km.dataplane import kernelview

# Entered in this order: the user namespace first (it decides what the
# others may do), the pid namespace last (it applies to children).
NAMESPACES = ("user", "mnt", "uts", "ipc", "net", "cgroup", "pid")
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
CAP_LAST_CAP_PATH = "/proc/sys/kernel/cap_last_cap"
CGROUP_ROOT = "/sys/fs/cgroup"

_libc = ctypes.CDLL(None, use_errno=True)


class EnterError(Exception):
    """The container cannot be entered; `str(error)` says why."""


def _check(rc: int, what: str) -> None:
    if rc != 0:
        code = ctypes.get_errno()
        raise EnterError(f"{what}: {os.strerror(code)}")


def open_namespaces(pid: int) -> list[tuple[str, int]]:
    """Descriptors of the namespaces of `pid` that differ from ours."""
    opened = []
    for ns in NAMESPACES:
        theirs = f"/proc/{pid}/ns/{ns}"
        try:
            if os.stat(theirs).st_ino == os.stat(f"/proc/self/ns/{ns}").st_ino:
                continue
            opened.append((ns, os.open(theirs, os.O_RDONLY | os.O_CLOEXEC)))
        except FileNotFoundError:
            continue  # a namespace this kernel does not have
        except OSError as error:
            raise EnterError(f"cannot open the {ns} namespace of pid {pid}: "
                             f"{error.strerror}") from None
    return opened


def cgroup_procs_files(cgroups: dict[str, str], root: str = CGROUP_ROOT) -> list[Path]:
    """The cgroup.procs files that put a process where `cgroups` says (v2 and v1)."""
    files = []
    mounted = Path(root)
    for key, path in cgroups.items():
        hierarchy, _, controllers = key.partition(":")
        relative = path.lstrip("/")
        if hierarchy == "0" and not controllers:
            base = mounted / "unified" if (mounted / "unified").is_dir() else mounted
        else:
            name = controllers.replace("name=", "")
            base = mounted / name
            if not base.is_dir():
                base = mounted / controllers
        target = base / relative / "cgroup.procs"
        if target.exists():
            files.append(target)
    return files


def join_cgroups(cgroups: dict[str, str]) -> None:
    for procs in cgroup_procs_files(cgroups):
        try:
            procs.write_text(f"{os.getpid()}\n")
        except OSError as error:
            print(f"cgpu-nsexec: warning: cannot join {procs.parent}: {error.strerror}",
                  file=sys.stderr)


def drop_capabilities(keep: int) -> None:
    """Remove every capability not in `keep` from the bounding set."""
    try:
        last = int(Path(CAP_LAST_CAP_PATH).read_text())
    except (OSError, ValueError):
        last = 40
    for cap in range(last + 1):
        if not keep & (1 << cap):
            _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")


def supplementary_groups(pid: int) -> list[int]:
    status = kernelview.parse_status(Path(f"/proc/{pid}/status").read_text())
    return [int(g) for g in status.get("Groups", "").split()]


def mapped_id(pid: int, kind: str, host_id: int) -> int:
    """An id of the host as the process's user namespace sees it (the same without one)."""
    try:
        lines = Path(f"/proc/{pid}/{kind}_map").read_text().splitlines()
    except OSError:
        return host_id
    for line in lines:
        inside, outside, count = (int(field) for field in line.split())
        if outside <= host_id < outside + count:
            return inside + host_id - outside
    return host_id


def enter(pid: int) -> None:
    """Become a process of the container `pid` is in (this process, from here on)."""
    info = kernelview.process_info(pid)
    if info is None:
        raise EnterError(f"no process {pid}")
    groups = supplementary_groups(pid)
    uid, gid = mapped_id(pid, "uid", info.uid), mapped_id(pid, "gid", info.gid)
    groups = [mapped_id(pid, "gid", g) for g in groups]
    spaces = open_namespaces(pid)
    join_cgroups(dict(info.cgroups))
    for ns, fd in spaces:
        _check(_libc.setns(fd, 0), f"entering the {ns} namespace of pid {pid}")
        os.close(fd)
    os.chdir("/")
    drop_capabilities(info.cap_bounding)
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "setting no_new_privs")


def run(pid: int, argv: Sequence[str], env: dict[str, str], timeout: float) -> int:
    try:
        enter(pid)
    except (EnterError, OSError) as error:
        print(f"cgpu-nsexec: cannot enter the container of pid {pid}: {error}", file=sys.stderr)
        return 125
    child = os.fork()
    if child == 0:
        try:
            os.execvpe(argv[0], list(argv), env)
        except OSError as error:
            print(f"cgpu-nsexec: cannot run {argv[0]} in the container: {error.strerror}",
                  file=sys.stderr)
        os._exit(127)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) if status >= 0 else 1
        if time.monotonic() >= deadline:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            print(f"cgpu-nsexec: {argv[0]} ran longer than {timeout:g} s and was killed",
                  file=sys.stderr)
            return 124
        time.sleep(0.01)


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cgpu_km.container.nsexec", description=__doc__)
    parser.add_argument("--pid", type=int, required=True, help="a host pid in the container")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--env", action="append", default=[], metavar="K=V")
    parser.add_argument("program", nargs=argparse.REMAINDER)
    parsed = parser.parse_args(args)
    program = parsed.program[1:] if parsed.program[:1] == ["--"] else parsed.program
    if not program:
        parser.error("no program given")
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    for item in parsed.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--env takes K=V, not {item!r}")
        env[key] = value
    return run(parsed.pid, program, env, parsed.timeout)


if __name__ == "__main__":
    sys.exit(main())
