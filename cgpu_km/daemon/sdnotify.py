"""systemd's notify protocol (sd_notify), self-contained.

Does nothing without `$NOTIFY_SOCKET`; handles abstract sockets (`@name`).
`watchdog_interval()` is half of `$WATCHDOG_USEC` when the watchdog is
meant for this process (`$WATCHDOG_PID` unset or ours), the rate at which
`WATCHDOG=1` should be sent.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

__all__ = ["Notifier", "watchdog_interval"]


def _address(value: str) -> str | bytes:
    return b"\0" + value[1:].encode() if value.startswith("@") else value


class Notifier:
    """Sends state lines to the service manager; a no-op when not run under it."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        target = env.get("NOTIFY_SOCKET", "")
        self._address: str | bytes | None = None
        if target and (target.startswith("@") or target.startswith("/")):
            self._address = _address(target)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *lines: str) -> bool:
        """Send `lines` (e.g. "READY=1") as one datagram; False if not sent."""
        if self._address is None:
            return False
        message = "\n".join(lines).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            try:
                sock.connect(self._address)
                sock.sendall(message)
            except OSError:
                return False
        return True

    def ready(self, status: str = "") -> bool:
        lines = ["READY=1"] + ([f"STATUS={status}"] if status else [])
        return self.notify(*lines)

    def reloading(self, monotonic_usec: int) -> bool:
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec}")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")


def watchdog_interval(env: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half the timeout), or None when not asked."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    owner = env.get("WATCHDOG_PID", "")
    if owner and owner.isdigit() and int(owner) != (os.getpid() if pid is None else pid):
        return None
    return int(usec) / 2e6
