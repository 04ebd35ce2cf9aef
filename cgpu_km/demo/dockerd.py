"""A Docker engine of its own, for the demo and the tests.

`PrivateDocker(folder)` runs `dockerd` with everything in `folder`: its data
root, exec root (and so its own containerd), pid file, socket and
daemon.json; no bridge and no iptables rules, so it leaves the host's
network alone. `docker(...)` runs the docker CLI against it (the one from
Debian's docker.io, which matches the engine). `stop()` removes its
containers (their poststop hooks run), stops the engine, unmounts what it
left and deletes the folder: nothing remains.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cgpu_km.children import stop_child

PACKAGE_CLI = "/usr/bin/docker"  # docker.io's client, the engine's own version


class DockerError(RuntimeError):
    """The engine did not start or a docker command failed; one line."""


def docker_cli() -> str:
    if os.access(PACKAGE_CLI, os.X_OK):
        return PACKAGE_CLI
    found = shutil.which("docker")
    if found is None:
        raise DockerError("the docker client is missing (apt-get install docker.io)")
    return found


def unmount_below(folder: Path) -> None:
    """Lazily unmount every mount point under `folder`, deepest first."""
    points = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            point = line.split()[4].replace("\\040", " ")
            if point == str(folder) or point.startswith(f"{folder}/"):
                points.append(point)
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


class PrivateDocker:
    def __init__(self, folder: Path, daemon_json: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, config_file: Path | None = None) -> None:
        self.folder = folder
        self.config_file = config_file or folder / "daemon.json"
        if config_file is None:
            self.config_file.write_text(json.dumps(dict(daemon_json or {})))
        self.extra_env = dict(env or {})
        self.process: subprocess.Popen[bytes] | None = None
        self.cli = docker_cli()

    @property
    def socket(self) -> Path:
        return self.folder / "docker.sock"

    @property
    def pidfile(self) -> Path:
        return self.folder / "docker.pid"

    @property
    def log(self) -> Path:
        return self.folder / "dockerd.log"

    @property
    def env(self) -> dict[str, str]:
        """The environment for docker commands (DOCKER_HOST set)."""
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}"}

    def start(self, timeout: float = 30) -> None:
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise DockerError("dockerd is missing (apt-get install docker.io)")
        command = [dockerd, "--data-root", str(self.folder / "data"),
                   "--exec-root", str(self.folder / "exec"), "--pidfile", str(self.pidfile),
                   "--host", f"unix://{self.socket}", "--config-file", str(self.config_file),
                   "--bridge", "none", "--iptables=false", "--ip-masq=false"]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **self.extra_env})
        deadline = time.monotonic() + timeout
        while self.docker("version", "--format", "{{.Server.Version}}").returncode != 0:
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace").splitlines()[-3:]
                self.stop()
                raise DockerError(f"dockerd did not start: {' / '.join(tail)}")
            time.sleep(0.1)

    def docker(self, *args: str, timeout: float = 120,
               input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.cli, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, input=input)

    def check(self, *args: str, timeout: float = 120) -> str:
        """Run a docker command that must succeed; its stdout."""
        result = self.docker(*args, timeout=timeout)
        if result.returncode != 0:
            raise DockerError(f"docker {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def runtimes(self) -> list[str]:
        out = self.docker("info", "--format", "{{json .Runtimes}}").stdout
        with contextlib.suppress(ValueError):
            return sorted(json.loads(out))
        return []

    def remove_containers(self) -> None:
        ids = self.docker("ps", "-aq").stdout.split()
        if ids:
            self.docker("rm", "-f", *ids)

    def stop(self) -> None:
        """Remove the containers, stop the engine, leave nothing behind."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                self.remove_containers()
            stop_child(self.process, 30)
        unmount_below(self.folder)
        shutil.rmtree(self.folder, ignore_errors=True)
