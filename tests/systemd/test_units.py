"""The service units: `systemd-analyze verify` and the offline security score, and
the notify protocol (`cgpu_km.daemon.sdnotify`) against a real datagram socket."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cgpu_km.daemon.sdnotify import Notifier, watchdog_interval

REPO = Path(__file__).resolve().parents[2]
UNITS = sorted((REPO / "systemd").glob("*.service"))
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def installed_copy(unit: Path, tmp_path: Path) -> Path:
    """The unit with /usr/local/bin pointing at this checkout's venv, where the programs are."""
    text = unit.read_text().replace("/usr/local/bin/", f"{Path(sys.executable).parent}/")
    copy = tmp_path / unit.name
    copy.write_text(text)
    return copy


def test_the_three_units_exist() -> None:
    assert [u.name for u in UNITS] == [
        "cgpu-daemon.service", "cgpu-fuse.service", "cgpu-kmod.service"
    ]


@needs_analyze
@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_verifies(unit: Path, tmp_path: Path) -> None:
    copy = installed_copy(unit, tmp_path)
    result = subprocess.run(
        [str(ANALYZE), "verify", "--man=no", str(copy)], capture_output=True, text=True,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"}, check=False,
    )
    # Only complaints about this unit count (the host's other units are not ours).
    ours = [line for line in result.stderr.splitlines() if unit.name in line]
    assert result.returncode == 0, result.stderr
    assert not ours, result.stderr


@needs_analyze
@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_is_hardened(unit: Path, tmp_path: Path) -> None:
    copy = installed_copy(unit, tmp_path)
    result = subprocess.run(
        [str(ANALYZE), "security", "--offline=true", "--no-pager", str(copy)],
        capture_output=True, text=True, check=False,
    )
    match = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= 5.5, result.stdout


def test_daemon_unit_keeps_what_the_daemon_needs() -> None:
    text = (REPO / "systemd" / "cgpu-daemon.service").read_text()
    settings = dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and line[:1] != "#"
    )
    assert settings["Type"] == "notify"
    assert "WatchdogSec" in settings
    assert settings["ExecReload"].endswith("-HUP $MAINPID")
    # These would break /proc/cgpu_km or /dev/nvidia* (see the unit's comments).
    assert "ProcSubset" not in settings
    assert "PrivateDevices" not in settings
    assert "ProtectProc" not in settings
    assert "char-nvidia-frontend rw" in text
    assert "RuntimeDirectoryPreserve=yes" in text
    # These give the service a procfs instance of its own (systemd 252), whose
    # /proc/cgpu_km sees no inotify events for writes made through the host's /proc.
    assert "ProtectKernelTunables" not in settings
    assert "ProtectControlGroups" not in settings
    assert "ReadOnlyPaths=/sys -/proc/sys " in text
    # The dispatchers' SCHED_FIFO 1 (Settings.dispatch_priority), without CAP_SYS_NICE.
    assert "RestrictRealtime" not in settings
    assert settings["LimitRTPRIO"] == "1"
    assert "CAP_SYS_NICE" not in settings["CapabilityBoundingSet"]


# Settings that give a service a mount namespace of its own.
MOUNT_NAMESPACE = ("PrivateTmp", "PrivateDevices", "PrivateMounts", "ProtectSystem",
                   "ProtectHome", "ProtectKernelModules", "ProtectKernelLogs",
                   "ProtectKernelTunables", "ProtectControlGroups", "ProtectProc", "ProcSubset",
                   "ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths", "BindPaths",
                   "TemporaryFileSystem")


def test_fuse_unit_mounts_in_the_hosts_namespace() -> None:
    """A FUSE mount made in a service's own mount namespace never reaches the host."""
    text = (REPO / "systemd" / "cgpu-fuse.service").read_text()
    keys = {line.split("=", 1)[0] for line in text.splitlines() if "=" in line and line[:1] != "#"}
    assert keys.isdisjoint(MOUNT_NAMESPACE), keys & set(MOUNT_NAMESPACE)


def receive(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_notify_to_a_path_socket(tmp_path: Path) -> None:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        notifier = Notifier({"NOTIFY_SOCKET": str(path)})
        assert notifier.enabled
        assert notifier.ready("2 GPUs")
        assert receive(sock) == "READY=1\nSTATUS=2 GPUs"
        assert notifier.watchdog()
        assert receive(sock) == "WATCHDOG=1"
        assert notifier.reloading(123)
        assert receive(sock) == "RELOADING=1\nMONOTONIC_USEC=123"
        assert notifier.stopping()
        assert receive(sock) == "STOPPING=1"


def test_notify_to_an_abstract_socket() -> None:
    name = f"cgpu-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert receive(sock) == "READY=1"


def test_notify_without_a_socket_does_nothing(tmp_path: Path) -> None:
    assert not Notifier({}).enabled
    assert not Notifier({}).ready()
    assert not Notifier({"NOTIFY_SOCKET": "relative"}).enabled
    assert not Notifier({"NOTIFY_SOCKET": str(tmp_path / "absent")}).ready()


def test_watchdog_interval_is_half_the_timeout_for_our_pid() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "10000000"}) == 5.0
    assert watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "2"}, pid=2) == 5.0
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "x"}) is None


def test_daemon_process_speaks_the_protocol(tmp_path: Path, control_tree: Path) -> None:
    """The real `cgpu-daemon` on the FUSE tree: READY, then STOPPING on SIGTERM, exit 0."""
    path = tmp_path / "notify"
    log = tmp_path / "daemon.log"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, log.open("w") as stderr:
        sock.bind(str(path))
        sock.settimeout(30)
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "cgpu-daemon"), "--root", str(control_tree),
             "--state-dir", str(tmp_path / "state"), "--region-dir", str(tmp_path / "regions")],
            env={**os.environ, "NOTIFY_SOCKET": str(path), "CGPU_SIMULATE": "1"},
            stderr=stderr,
        )
        try:
            assert receive(sock).startswith("READY=1"), log.read_text()
            process.send_signal(15)
            assert receive(sock) == "STOPPING=1"
            assert process.wait(timeout=30) == 0, log.read_text()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert (tmp_path / "state" / "daemon-state.json").exists()
