"""Stopping a process over its container's limit: the eGPU OOM script inside the
container, then SIGKILL."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping

from cgpu_km.dataplane import kernelview

log = logging.getLogger("cgpu-daemon")

OOM_SCRIPT_TIMEOUT = 5.0


def stop_process(pid: int, *, oom_script: str = "", owner: kernelview.Owner | None = None,
                 env: Mapping[str, str] | None = None,
                 timeout: float = OOM_SCRIPT_TIMEOUT,
                 runner: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
                 kill: Callable[[], None] | None = None) -> None:
    """Stop a process over its container's limit: in eGPU mode its container's
    OOM script first, run inside the container `owner` names, under its
    sandbox (`cgpu_km.container.nsexec`), then SIGKILL (`kill`, when the
    caller holds a pidfd of the process).

    Blocking (up to `timeout` and a little); the daemon calls it in a task of
    its own, never where the heartbeat or the scheduler would wait."""
    if oom_script and owner is None:
        log.warning("OOM script %s for pid %d not run: its container's identity is unknown",
                    oom_script, pid)
    elif oom_script and owner is not None:
        extra = [f"--env={k}={v}" for k, v in sorted((env or {}).items())]
        try:
            result = runner([sys.executable, "-m", "cgpu_km.container.nsexec", f"--pid={pid}",
                             f"--owner={owner.to_json()}", f"--timeout={timeout}", *extra,
                             "--", oom_script],
                            capture_output=True, text=True, timeout=timeout + 10, check=False,
                            stdin=subprocess.DEVNULL)
            if result.returncode != 0:
                detail = (result.stderr.strip().splitlines() or [f"status {result.returncode}"])
                log.warning("OOM script %s for pid %d: %s", oom_script, pid, detail[-1])
        except (OSError, subprocess.TimeoutExpired) as error:
            log.warning("OOM script %s for pid %d failed: %s", oom_script, pid, error)
    try:
        if kill is not None:
            kill()
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError as error:
        log.warning("cannot stop pid %d: %s", pid, error)
