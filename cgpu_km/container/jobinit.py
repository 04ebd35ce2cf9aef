"""The first process of a `cgpu-run` job's pid namespace: runs the command, passes signals on.

    python -m cgpu_km.container.jobinit CMD [ARG ...]

A pid namespace's first process gets from outside only the signals it has
handlers for, and its children are reparented to it. This one runs CMD,
hands every signal `cgpu-run` forwards on to CMD, reaps whatever is
reparented to it, and exits when CMD does: with CMD's status, or 128+N when
a signal N ended it (the first process of a namespace cannot be ended by a
signal it raises itself).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


def main(argv: Sequence[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("usage: python -m cgpu_km.container.jobinit CMD [ARG ...]", file=sys.stderr)
        return 2
    child = os.fork()
    if child == 0:
        # cgpu-run starts us with these blocked, so none is lost before the
        # handlers below exist; CMD gets them as usual.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        try:
            os.execvp(command[0], command)
        except OSError as error:
            print(f"cgpu-run: cannot run {command[0]}: {error.strerror}", file=sys.stderr)
        os._exit(127)

    def forward(signum: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 1
        except InterruptedError:
            continue
        if pid == child:
            if os.WIFSIGNALED(status):
                return 128 + os.WTERMSIG(status)
            return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
