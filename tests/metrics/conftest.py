"""Fixtures: a known snapshot (checked in here), a metrics server for it, a real Prometheus."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cgpu_km.children import stop_child
from cgpu_km.daemon.metrics import MetricsServer, SnapshotHolder, serve_metrics
from cgpu_km.daemon.snapshot import Snapshot

KNOWN_SNAPSHOT = Path(__file__).with_name("known_snapshot.json")
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


@pytest.fixture
def known_snapshot() -> Snapshot:
    return Snapshot.from_json(KNOWN_SNAPSHOT.read_text())


@pytest.fixture(scope="module")
def metrics_server() -> Iterator[MetricsServer]:
    """Serves the known snapshot (module-wide: a server takes 0.5 s to stop)."""
    snapshot = Snapshot.from_json(KNOWN_SNAPSHOT.read_text())
    server = serve_metrics("127.0.0.1", 0, SnapshotHolder(snapshot))
    try:
        yield server
    finally:
        server.close()


def scrape(server: MetricsServer) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


@pytest.fixture
def scraped(metrics_server: MetricsServer) -> str:
    """The text of one real HTTP scrape of the known snapshot."""
    return scrape(metrics_server)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PrometheusServer:
    """A real Prometheus on loopback scraping `target` every second, with temporary storage."""

    def __init__(self, folder: Path, target: str) -> None:
        assert PROMETHEUS is not None, "the fixture skips when prometheus is not installed"
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: cgpu\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / "prometheus.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        self.wait_for(lambda: self._get("/-/ready") is not None, "Prometheus ready")

    def _get(self, path: str) -> bytes | None:
        if self.process.poll() is not None:
            raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as reply:
                return bytes(reply.read())
        except (urllib.error.URLError, ConnectionError):
            return None

    def query(self, expr: str) -> dict[str, Any]:
        """The API's answer to an instant query (`status`, `data`)."""
        text = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        if text is None:
            raise RuntimeError(f"no answer to {expr!r}")
        answer: dict[str, Any] = json.loads(text)
        return answer

    def wait_for(self, condition: Callable[[], object], what: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                log = self.log.read_text()[-2000:]
                raise AssertionError(f"timed out waiting for {what}: {log}")
            time.sleep(0.1)

    def vector(self, expr: str) -> list[dict[str, Any]]:
        answer = self.query(expr)
        assert answer["status"] == "success", answer
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def stop(self) -> None:
        stop_child(self.process, 10)


@pytest.fixture(scope="module")
def start_prometheus(
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], PrometheusServer]]:
    """Start a Prometheus scraping HOST:PORT (skips when Debian's `prometheus` is missing).

    Its first scrape comes about 5 s after the start (target discovery and
    the scrape manager each batch updates every 5 s): share one per module.
    """
    tmp_path = tmp_path_factory.mktemp("prometheus")
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian package `prometheus`)")
    servers: list[PrometheusServer] = []

    def start(target: str) -> PrometheusServer:
        servers.append(PrometheusServer(tmp_path / f"prometheus{len(servers)}", target))
        return servers[-1]

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def promtool() -> str:
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`)")
    return PROMTOOL


@pytest.fixture(scope="module")
def prometheus(metrics_server: MetricsServer,
               start_prometheus: Callable[[str], PrometheusServer]) -> PrometheusServer:
    """A Prometheus that has scraped the known snapshot once."""
    server = start_prometheus(f"127.0.0.1:{metrics_server.port}")
    server.wait_for(
        lambda: server.vector('cgpu_container_memory_limit_bytes{container="abc123def456"}'),
        "the first scrape")
    return server
