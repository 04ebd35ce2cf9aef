"""A known snapshot (checked in next to the tests) and a metrics server serving it."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpu_km.metrics import MetricsServer, SnapshotHolder, serve_metrics
from cgpu_km.snapshot import Snapshot

KNOWN_SNAPSHOT = Path(__file__).with_name("known_snapshot.json")


@pytest.fixture
def known_snapshot() -> Snapshot:
    return Snapshot.from_json(KNOWN_SNAPSHOT.read_text())


@pytest.fixture
def metrics_server(known_snapshot: Snapshot) -> Iterator[MetricsServer]:
    server = serve_metrics("127.0.0.1", 0, SnapshotHolder(known_snapshot))
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
