"""Futex words shared with libcgpu: wake the waiters of one, or wait on many.

`wait_any` blocks until any of several 32-bit words changes from the value
the caller last saw, or a deadline passes: futex_waitv(2) (Linux 5.16 and
later) where the kernel has it, else a short sleep (the caller re-reads).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import time
from collections.abc import Sequence

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221}.get(platform.machine(), 202)
_SYS_FUTEX_WAITV = 449  # the same number on every architecture
_FUTEX_WAKE = 1
_FUTEX2_SIZE_U32 = 0x02
_FUTEX2_PRIVATE = 128
_CLOCK_MONOTONIC = 1
FALLBACK_SLEEP = 0.001

_libc = ctypes.CDLL(None, use_errno=True)  # calls that block: they let other threads run
_libc.syscall.restype = ctypes.c_long
# Calls that return at once (a wake) keep the interpreter's lock: released, each
# would be a hand-off to whichever thread waits for it, and a wait to take it back.
_libc_now = ctypes.PyDLL(None)
_libc_now.syscall.restype = ctypes.c_long


class _Waiter(ctypes.Structure):
    _fields_ = (
        ("val", ctypes.c_uint64),
        ("uaddr", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    )


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


_have_waitv = True


def wake_all(address: int) -> None:
    """Wake every process waiting on the shared futex word at `address`."""
    _wake(address, _FUTEX_WAKE)


def wake_private(address: int) -> None:
    """Wake a thread of this process waiting on a private word at `address`."""
    _wake(address, _FUTEX_WAKE | _FUTEX2_PRIVATE)


def _wake(address: int, op: int) -> None:
    _libc_now.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(op),
                      ctypes.c_int(2**31 - 1), None, None, ctypes.c_int(0))


def wait_any(words: Sequence[tuple[int, int, bool]], deadline_ns: int) -> int:
    """Wait until a word changes or CLOCK_MONOTONIC reaches `deadline_ns`.

    `words`: (address, the value last seen, shared between processes). At
    most 128 words (the kernel's limit); returns early, never late: the index
    of the word that was woken, else -1 (a deadline, a value that had already
    changed, or no futex_waitv)."""
    now = time.monotonic_ns()
    if deadline_ns <= now:
        return -1
    if not words or len(words) > 128 or not _have_waitv:
        time.sleep(min(FALLBACK_SLEEP, (deadline_ns - now) / 1e9) if words else
                   (deadline_ns - now) / 1e9)
        return -1
    waiters = (_Waiter * len(words))()
    for waiter, (address, value, shared) in zip(waiters, words, strict=True):
        waiter.uaddr = address
        waiter.val = value & 0xFFFFFFFF
        waiter.flags = _FUTEX2_SIZE_U32 | (0 if shared else _FUTEX2_PRIVATE)
    return _waitv(waiters, len(words), deadline_ns)


class WaitSet:
    """`wait_any` over one reusable array: a wait writes only the words that
    differ from the last wait's (a dispatcher waits on much the same words
    every time, and filling the kernel's array costs more than the wait)."""

    def __init__(self) -> None:
        self._array = (_Waiter * 8)()
        self._held: list[tuple[int, int, bool]] = []

    def wait(self, words: Sequence[tuple[int, int, bool]], deadline_ns: int) -> int:
        """As `wait_any`."""
        n = len(words)
        if not words or n > 128 or not _have_waitv:
            return wait_any(words, deadline_ns)
        if n > len(self._array):
            self._array = (_Waiter * max(n, 2 * len(self._array)))()
            self._held = []
        held, array = self._held, self._array
        for i, word in enumerate(words):
            if i >= len(held) or held[i] != word:
                waiter = array[i]
                address, value, shared = word
                waiter.uaddr = address
                waiter.val = value & 0xFFFFFFFF
                waiter.flags = _FUTEX2_SIZE_U32 | (0 if shared else _FUTEX2_PRIVATE)
        self._held = list(words)
        return _waitv(array, n, deadline_ns)


def _waitv(waiters: ctypes.Array[_Waiter], n: int, deadline_ns: int) -> int:
    """futex_waitv(2) on the first `n` of `waiters` until `deadline_ns`."""
    global _have_waitv
    now = time.monotonic_ns()
    if deadline_ns <= now:
        return -1
    timeout = _Timespec(deadline_ns // 1_000_000_000, deadline_ns % 1_000_000_000)
    rc = _libc.syscall(ctypes.c_long(_SYS_FUTEX_WAITV), waiters, ctypes.c_uint(n),
                       ctypes.c_uint(0), ctypes.byref(timeout), ctypes.c_int(_CLOCK_MONOTONIC))
    if rc < 0 and ctypes.get_errno() == errno.ENOSYS:
        _have_waitv = False
        time.sleep(min(FALLBACK_SLEEP, (deadline_ns - now) / 1e9))
    return int(rc) if rc >= 0 else -1


def available() -> bool:
    """Whether the kernel has futex_waitv (else waits poll every millisecond)."""
    return _have_waitv and os.uname().sysname == "Linux"
