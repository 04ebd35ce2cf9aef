"""Run a program inside a container, as one of its processes runs: never on the host.

    python -m cgpu_km.container.nsexec --pid HOSTPID --owner OWNER_JSON [--timeout S] \
        [--env K=V ...] -- PROGRAM [ARG ...]

The daemon uses it for the eGPU OOM script, a path the container chose. This
process (a fresh, single-threaded interpreter started by the daemon as
root) pins HOSTPID with a pidfd and checks that it is still a process of
the container OWNER_JSON names (`kernelview.Owner`: its pid namespace or
cgroup), and that its mount and pid namespaces are not the host's: a pid
that was reused by a host process runs nothing. It copies HOSTPID's seccomp
filters (ptrace PTRACE_SECCOMP_GET_FILTER) and reads its LSM label
(AppArmor, SELinux). Only then does it join its cgroups, enter its user,
mount, UTS, IPC, network, cgroup and pid namespaces, give up every
capability outside HOSTPID's bounding set, take HOSTPID's uid, gid and
groups, set no_new_privs, and fork: the child (in the container's pid
namespace) installs the filters, asks for the label at exec and executes
PROGRAM as resolved in the container's file system. It is killed after the
timeout. PROGRAM's stdout and stderr both go to this process's stdout; this
process's own messages go to its stderr. Exit status: PROGRAM's, 124 on
timeout, 125 when the container could not be entered or its sandbox not
reproduced (one line on stderr says why; nothing ran).

Every wait is bounded: HOSTPID is stopped for the copy of its filters, and a
process whose thread waits in vfork() never reports that stop, so after
`STOP_WAIT` seconds the copy is given up and nothing runs.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cgpu_km.dataplane import kernelview

# Entered in this order: the user namespace first (it decides what the
# others may do), the pid namespace last (it applies to children).
NAMESPACES = ("user", "mnt", "uts", "ipc", "net", "cgroup", "pid")
# A container always has these of its own: the host's means the pid is not
# (any more) a container's process.
OWN_NAMESPACES = ("mnt", "pid")
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_SECCOMP_GET_FILTER = 0x420C
WALL = 0x40000000  # __WALL: wait for a tracee that is not our child
STOP_WAIT = 1.0  # seconds HOSTPID has to stop for the copy of its seccomp filters
SOCK_FILTER_SIZE = 8  # struct sock_filter: u16 code, u8 jt, u8 jf, u32 k
CAP_LAST_CAP_PATH = "/proc/sys/kernel/cap_last_cap"
CGROUP_ROOT = "/sys/fs/cgroup"
UNCONFINED = ("", "unconfined")  # no label, or AppArmor's "no profile"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = (ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_libc.ptrace.restype = ctypes.c_long
_libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                        ctypes.c_ulong)


class SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


class EnterError(Exception):
    """The container cannot be entered; `str(error)` says why."""


def _check(rc: int, what: str) -> None:
    if rc != 0:
        code = ctypes.get_errno()
        raise EnterError(f"{what}: {os.strerror(code)}")


def _host_namespace(ns: str) -> set[int]:
    """Inodes of the host's namespace of this kind: init's and ours."""
    found = set()
    for pid in ("1", "self"):
        try:
            found.add(os.stat(f"/proc/{pid}/ns/{ns}").st_ino)
        except OSError:
            continue
    return found


def open_namespaces(pid: int) -> list[tuple[str, int]]:
    """Descriptors of the namespaces of `pid` that differ from ours. EnterError
    when its mount or pid namespace is the host's."""
    opened: list[tuple[str, int]] = []
    try:
        for ns in NAMESPACES:
            theirs = f"/proc/{pid}/ns/{ns}"
            try:
                fd = os.open(theirs, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                if ns in OWN_NAMESPACES:
                    raise EnterError(f"pid {pid} has no {ns} namespace (it is gone)") from None
                continue  # a namespace this kernel does not have
            except OSError as error:
                raise EnterError(f"cannot open the {ns} namespace of pid {pid}: "
                                 f"{error.strerror}") from None
            inode = os.fstat(fd).st_ino
            if ns in OWN_NAMESPACES and inode in _host_namespace(ns):
                os.close(fd)
                raise EnterError(f"pid {pid} is in the host's {ns} namespace: "
                                 "not a container's process")
            if inode == os.stat(f"/proc/self/ns/{ns}").st_ino:
                os.close(fd)
                continue
            opened.append((ns, fd))
    except BaseException:
        for _ns, fd in opened:
            os.close(fd)
        raise
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
    status = kernelview.parse_status(kernelview.read_proc(f"/proc/{pid}/status"))
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


def seccomp_filters(pid: int) -> list[bytes]:
    """`pid`'s seccomp filters as cBPF programs, the first installed first
    ([] when it has none). The process is stopped (PTRACE_INTERRUPT) for the
    copy, then let go (a process stopped before stays stopped); EnterError
    when they cannot be copied, or when it did not stop within `STOP_WAIT`
    (a thread in vfork() stops only when its child execs or exits)."""
    status = kernelview.parse_status(kernelview.read_proc(f"/proc/{pid}/status"))
    mode = status.get("Seccomp", "0")
    if mode == "0":
        return []
    if mode != str(SECCOMP_MODE_FILTER):
        raise EnterError(f"pid {pid} runs in seccomp mode {mode}, which cannot be copied")
    if _libc.ptrace(PTRACE_SEIZE, pid, None, None) != 0:
        raise EnterError(f"cannot copy the seccomp filter of pid {pid}: ptrace: "
                         f"{os.strerror(ctypes.get_errno())}")
    try:
        _check(int(_libc.ptrace(PTRACE_INTERRUPT, pid, None, None)), "ptrace interrupt")
        wait_stopped(pid, STOP_WAIT)
        programs = []
        for index in range(4096):
            count = int(_libc.ptrace(PTRACE_SECCOMP_GET_FILTER, pid, index, None))
            if count < 0:
                if ctypes.get_errno() == errno.ENOENT:
                    break  # past the oldest
                raise EnterError(f"cannot copy the seccomp filter of pid {pid}: "
                                 f"{os.strerror(ctypes.get_errno())}")
            buffer = ctypes.create_string_buffer(count * SOCK_FILTER_SIZE)
            if _libc.ptrace(PTRACE_SECCOMP_GET_FILTER, pid, index, buffer) != count:
                raise EnterError(f"the seccomp filter {index} of pid {pid} changed")
            programs.append(buffer.raw)
    finally:
        _libc.ptrace(PTRACE_DETACH, pid, None, None)
    if not programs:
        raise EnterError(f"pid {pid} runs under seccomp but no filter could be read")
    return programs[::-1]  # index 0 is the newest


def wait_stopped(pid: int, seconds: float) -> None:
    """Wait, at most `seconds`, for the tracee `pid` to report its stop; EnterError
    when it did not (never an unbounded waitpid: a thread in vfork() would hold it)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            done, _status = os.waitpid(pid, os.WNOHANG | WALL)
        except ChildProcessError:
            raise EnterError(f"pid {pid} exited while its seccomp filter was copied") from None
        if done:
            return
        if time.monotonic() >= deadline:
            raise EnterError(f"pid {pid} did not stop within {seconds:g} s for the copy of its "
                             "seccomp filter (a thread of it may wait in vfork)")
        time.sleep(0.001)


def install_seccomp(programs: Sequence[bytes]) -> None:
    """Install cBPF filters in this process (no_new_privs must be set)."""
    for program in programs:
        buffer = ctypes.create_string_buffer(program, len(program))
        fprog = SockFprog(len(program) // SOCK_FILTER_SIZE, ctypes.addressof(buffer))
        _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0),
               "installing the container's seccomp filter")


def lsm_label(pid: int) -> str:
    """`pid`'s LSM label (AppArmor profile or SELinux context); "" without one."""
    try:
        label = Path(f"/proc/{pid}/attr/current").read_bytes()
    except OSError as error:
        if error.errno in (errno.EINVAL, errno.ENOENT, errno.EOPNOTSUPP):
            return ""  # no LSM that labels processes
        raise EnterError(f"cannot read the LSM label of pid {pid}: {error.strerror}") from None
    text = label.rstrip(b"\0\n").decode(errors="replace")
    text = text.removesuffix(" (enforce)").removesuffix(" (complain)")
    return "" if text in UNCONFINED else text


def request_lsm_label(label: str) -> None:
    """Ask for `label` at the next exec (AppArmor `exec PROFILE`, SELinux context)."""
    attr = "/proc/self/attr/apparmor/exec"
    value = f"exec {label}"
    if not os.path.exists(attr):
        attr = "/proc/self/attr/exec"
        value = label if ":" in label else value  # SELinux contexts are user:role:type:level
    with open(attr, "w") as handle:
        handle.write(value)


@dataclass(frozen=True)
class Sandbox:
    """What the container's processes run under and the child must get."""

    seccomp: tuple[bytes, ...]
    lsm_label: str

    def apply(self) -> None:
        """In the child, just before exec."""
        if self.lsm_label:
            request_lsm_label(self.lsm_label)
        install_seccomp(self.seccomp)


def pin(pid: int, owner: kernelview.Owner) -> int:
    """A pidfd of `pid` after checking that it is a process of the container
    `owner` names; EnterError otherwise."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as error:
        raise EnterError(f"no process {pid}: {error.strerror}") from None
    info = kernelview.process_info(pid)
    host = kernelview.Host.read()
    if info is None or not kernelview.belongs(info, owner, host):
        os.close(pidfd)
        raise EnterError(f"pid {pid} is not a process of the container")
    return pidfd


def still_running(pidfd: int, pid: int) -> None:
    """While the pidfd's process runs, `pid` names it: what was read of /proc/pid
    since the pidfd was opened was read of that process."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        raise EnterError(f"pid {pid} exited while the container was being entered") from None


def enter(pid: int, owner: kernelview.Owner) -> Sandbox:
    """Become a process of the container `pid` is in (this process, from here
    on); the sandbox the program must get at exec."""
    pidfd = pin(pid, owner)
    try:
        info = kernelview.process_info(pid)
        if info is None:
            raise EnterError(f"no process {pid}")
        groups = supplementary_groups(pid)
        uid, gid = mapped_id(pid, "uid", info.uid), mapped_id(pid, "gid", info.gid)
        groups = [mapped_id(pid, "gid", g) for g in groups]
        spaces = open_namespaces(pid)
        try:
            sandbox = Sandbox(tuple(seccomp_filters(pid)), lsm_label(pid))
            still_running(pidfd, pid)
        except BaseException:
            for _ns, fd in spaces:
                os.close(fd)
            raise
    finally:
        os.close(pidfd)
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
    return sandbox


def run(pid: int, owner: kernelview.Owner, argv: Sequence[str], env: dict[str, str],
        timeout: float) -> int:
    try:
        sandbox = enter(pid, owner)
    except (EnterError, OSError) as error:
        print(f"cgpu-nsexec: cannot enter the container of pid {pid}: {error}", file=sys.stderr)
        return 125
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        report = os.dup(2)  # this process's messages (close-on-exec)
        os.dup2(1, 2)  # the program's stderr goes where its stdout goes
        try:
            sandbox.apply()
        except (EnterError, OSError) as error:
            os.write(report, f"cgpu-nsexec: {argv[0]} not run: the container's sandbox: "
                             f"{error}\n".encode(errors="backslashreplace"))
            os._exit(125)
        try:
            os.execvpe(argv[0], list(argv), env)
        except OSError as error:
            os.write(report, f"cgpu-nsexec: cannot run {argv[0]} in the container: "
                             f"{error.strerror}\n".encode(errors="backslashreplace"))
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
    parser.add_argument("--owner", required=True, metavar="JSON",
                        help="the container's recorded identity (kernelview.Owner as JSON)")
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
    try:
        owner = kernelview.Owner.from_json(parsed.owner)
    except (ValueError, KeyError, TypeError) as error:
        parser.error(f"--owner is not a container identity: {error}")
    return run(parsed.pid, owner, program, env, parsed.timeout)


if __name__ == "__main__":
    sys.exit(main())
