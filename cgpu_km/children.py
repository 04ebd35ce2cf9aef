"""Stopping a child process: a signal, a grace period, then SIGKILL."""

from __future__ import annotations

import signal
import subprocess
from typing import Any


def stop_child(process: subprocess.Popen[Any], grace: float = 15.0, *,
               signum: int | None = signal.SIGTERM) -> int | None:
    """Send `signum` (None: it was asked to stop some other way), wait up to
    `grace` seconds, then kill it; its exit status, or None when it was killed."""
    if signum is not None and process.poll() is None:
        process.send_signal(signum)
    try:
        return process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None
