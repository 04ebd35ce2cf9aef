"""Stopping a process: SIGKILL through a pidfd, and in eGPU mode the
container's OOM script first, run inside the container while the process is
frozen.

The daemon's stops service (`cgpu_km.daemon.stops`) drives a `Target` step by
step, each stop in a thread of its own: `freeze`, `kill` and `gone` return at
once; `start_script` starts `cgpu_km.container.nsexec` in a session of its
own, and the daemon looks at the `ScriptProcess` (`ended`) until it ends or
its deadline comes; `end` then kills whatever is left of it (its process
group, and every process whose parent chain leads to it) and collects its
status and the tail of its output. Nothing here waits on a pipe that the
script's children may hold: the output is read as it comes, without blocking,
and whatever is unread when the script ends is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from cgpu_km.dataplane import kernelview

log = logging.getLogger("cgpu-daemon")

OOM_SCRIPT_TIMEOUT = 5.0  # seconds an OOM script may run; then it and all it started are killed
OUTPUT_TAIL = 1024  # bytes of a script's output kept (its last)
REPORT_MAX = 2048  # bytes of nsexec's own messages kept (its first)
READ_CHUNK = 65536  # read at most this much of a pipe per look
REAP_WAIT = 5.0  # seconds to wait for nsexec, killed, to be reaped
NSEXEC_GRACE = 1.0  # nsexec's own timeout is the daemon's plus this (a fallback)


@dataclass(frozen=True)
class ScriptResult:
    """How an OOM script ended."""

    status: int | None  # nsexec's exit status (the script's; 125: it did not run); None: killed
    output: bytes  # the last OUTPUT_TAIL bytes it wrote (stdout and stderr)
    written: int  # bytes it wrote in all
    report: str  # nsexec's own message: why the script did not run, or ""


class ScriptProcess:
    """`cgpu_km.container.nsexec` running an OOM script: a session (and process
    group) of its own; the script's stdout and stderr in one pipe, nsexec's own
    messages in another, both read without blocking.

    nsexec is not reaped before `end` has killed its process group, so that the
    group's id cannot name another group meanwhile."""

    def __init__(self, argv: list[str]) -> None:
        out_read, out_write = os.pipe()
        report_read, report_write = os.pipe()
        try:
            self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out_write,
                                          stderr=report_write, start_new_session=True,
                                          close_fds=True)
        except BaseException:
            for fd in (out_read, report_read):
                os.close(fd)
            raise
        finally:
            os.close(out_write)
            os.close(report_write)
        for fd in (out_read, report_read):
            os.set_blocking(fd, False)
        self.pid = self.popen.pid
        self._pipes: dict[int, bytearray] = {out_read: bytearray(), report_read: bytearray()}
        self._out, self._report = out_read, report_read
        self._written = 0
        self._reaped = False

    def _drain(self) -> None:
        """Read what the pipes hold now (at most READ_CHUNK of each)."""
        for fd in list(self._pipes):
            try:
                chunk = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:  # everyone that held it closed it
                continue
            kept = self._pipes[fd]
            if fd == self._out:
                self._written += len(chunk)
                kept += chunk
                del kept[:-OUTPUT_TAIL]
            elif len(kept) < REPORT_MAX:
                kept += chunk[:REPORT_MAX - len(kept)]

    def ended(self) -> bool:
        """Whether nsexec exited (returns at once; reads what it wrote so far)."""
        self._drain()
        if self._reaped:
            return True
        try:
            found = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return found is not None

    def kill(self) -> None:
        """SIGKILL to its process group: nsexec, the script and what the script
        started, unless it left the group (returns at once)."""
        if not self._reaped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def end(self) -> ScriptResult:
        """Kill what is left of it and collect its status and output (blocking,
        briefly: a /proc walk and the reaping of nsexec, killed)."""
        ended = self.ended()
        strays = descendants(self.pid)
        self.kill()
        for fd in strays:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
        status: int | None = None
        try:
            code = self.popen.wait(timeout=REAP_WAIT)
            status = code if ended else None
            self._reaped = True
        except subprocess.TimeoutExpired:
            log.warning("cgpu-nsexec (pid %d) did not exit %g s after SIGKILL", self.pid,
                        REAP_WAIT)
        self._drain()
        for fd in self._pipes:
            os.close(fd)
        report = bytes(self._pipes[self._report]).decode(errors="replace").strip()
        return ScriptResult(status, bytes(self._pipes[self._out]), self._written, report)


def descendants(pid: int, proc: str = kernelview.PROC) -> list[int]:
    """Pidfds of every process whose parent chain leads to `pid` (not `pid`
    itself), each checked to still have the parent it was found with."""
    parents: dict[int, int] = {}
    with contextlib.suppress(OSError), os.scandir(proc) as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            parent = _parent(int(entry.name), proc)
            if parent is not None:
                parents[int(entry.name)] = parent
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    todo = list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        try:
            fd = os.pidfd_open(child)
        except OSError:
            continue
        if _parent(child, proc) != parents[child]:  # the pid names another process now
            os.close(fd)
            continue
        found.append(fd)
        todo.extend(children.get(child, ()))
    return found


def _parent(pid: int, proc: str) -> int | None:
    try:
        stat = kernelview.read_proc(f"{proc}/{pid}/stat")
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class Target:
    """A process to stop, pinned by a pidfd: signals reach that process or none."""

    def __init__(self, pid: int, pidfd: int, *, oom_script: str = "",
                 owner: kernelview.Owner | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.oom_script = oom_script if owner is not None else ""
        self.owner = owner
        self.env = dict(env or {})
        if oom_script and owner is None:
            log.warning("OOM script %s for pid %d not run: its container's identity is "
                        "unknown", printable(oom_script), pid)

    @classmethod
    def open(cls, pid: int, *, oom_script: str = "", owner: kernelview.Owner | None = None,
             env: Mapping[str, str] | None = None) -> Target | None:
        """`pid` pinned now (None when there is no such process)."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return None
        return cls(pid, pidfd, oom_script=oom_script, owner=owner, env=env)

    def _signal(self, sig: signal.Signals) -> None:
        try:
            signal.pidfd_send_signal(self.pidfd, sig)
        except ProcessLookupError:
            pass
        except PermissionError as error:
            log.warning("cannot send %s to pid %d: %s", sig.name, self.pid, error)

    def freeze(self) -> None:
        """SIGSTOP: the process runs no more until it is killed (returns at once)."""
        self._signal(signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL, which a stopped process gets too (returns at once)."""
        self._signal(signal.SIGKILL)

    def gone(self) -> bool:
        """Whether the process has exited (its pidfd is readable; returns at once)."""
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def start_script(self, timeout: float) -> ScriptProcess:
        """Start the OOM script inside the container (blocking, briefly: a fork and
        an exec). OSError when it cannot be started."""
        assert self.owner is not None
        extra = [f"--env={k}={v}" for k, v in sorted(self.env.items())]
        return ScriptProcess([sys.executable, "-m", "cgpu_km.container.nsexec",
                              f"--pid={self.pid}", f"--owner={self.owner.to_json()}",
                              f"--timeout={timeout + NSEXEC_GRACE}", *extra, "--",
                              self.oom_script])

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def printable(text: str) -> str:
    """`text` as it is when it is one printable line; quoted, control characters
    escaped, when it is not."""
    return text if text.isprintable() and text.strip() == text and text else repr(text)


def quoted_lines(output: bytes, *, lines: int = 3, width: int = 200) -> list[str]:
    """The last `lines` non-empty lines of `output`, each quoted (repr: control
    characters and bytes that are not UTF-8 escaped) and cut at `width` characters."""
    text = output.decode(errors="backslashreplace")
    found = [line for line in text.split("\n") if line.strip()][-lines:]
    return [repr(line if len(line) <= width else line[:width] + "...") for line in found]


def stop_process(pid: int, *, oom_script: str = "", owner: kernelview.Owner | None = None,
                 env: Mapping[str, str] | None = None,
                 timeout: float = OOM_SCRIPT_TIMEOUT) -> None:
    """Stop `pid` at once, synchronously: frozen, its OOM script (inside the
    container `owner` names, at most `timeout` seconds), then SIGKILL. The
    daemon drives a `Target` itself (`cgpu_km.daemon.stops`); this is for
    tools and tests."""
    target = Target.open(pid, oom_script=oom_script, owner=owner, env=env)
    if target is None:
        return
    try:
        if target.oom_script:
            target.freeze()
            try:
                script = target.start_script(timeout)
            except OSError as error:
                log.warning("OOM script %s for pid %d failed: %s", printable(oom_script), pid,
                            error)
            else:
                deadline = time.monotonic() + timeout
                while not script.ended() and time.monotonic() < deadline:
                    time.sleep(0.01)
                script.end()
        target.kill()
    finally:
        target.close()
