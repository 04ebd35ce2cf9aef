"""Prometheus metrics: a custom collector over the daemon's latest snapshot.

`collect()` reads one immutable `Snapshot` that the daemon's task swaps
into a `SnapshotHolder`; it never touches the scheduler's live state. The
HTTP server (`serve_metrics`) runs in its own thread.

Names follow the Prometheus conventions: one `cgpu_` prefix, base units
(`_bytes`, `_seconds`, `_ratio` from 0 to 1), `_total` for counters, and
the labels `gpu`, `uuid`, `container`, never a PID. `METRICS` lists every
family; docs/operator/metrics.md's table is written from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cgpu_km.daemon.snapshot import Snapshot

DEFAULT_LISTEN = "127.0.0.1:9400"
SnapshotProvider = Callable[[], Snapshot | None]

GPU_LABELS = ("gpu", "uuid")
CONTAINER_LABELS = ("gpu", "uuid", "container")


@dataclass(frozen=True)
class MetricSpec:
    """One exported family: full name (counters end in `_total`), type, labels, help, value.

    `value` maps the subject (the Snapshot, a GpuFigures or a ContainerFigures)
    to the sample's value, or for an info metric to its info labels; None
    means unknown, and then the sample is left out rather than faked.
    """

    name: str
    kind: str  # gauge, counter or info
    labels: tuple[str, ...]
    help: str
    value: Callable[[Any], float | dict[str, str] | None]
    info_labels: tuple[str, ...] = ()


def _ratio(percent: int) -> float:
    return percent / 100


DAEMON_METRICS = (
    MetricSpec("cgpu_build_info", "info", (), "Build of the cgpu_km daemon (value 1).",
               lambda s: {"version": s.version}, ("version",)),
    MetricSpec("cgpu_scheduler_period_seconds", "gauge", (), "Scheduling period of the daemon.",
               lambda s: s.period_seconds),
    MetricSpec("cgpu_daemon_start_time_seconds", "gauge", (), "Unix time the daemon started.",
               lambda s: s.started),
    MetricSpec("cgpu_snapshot_timestamp_seconds", "gauge", (),
               "Unix time the daemon took the state these metrics show.", lambda s: s.timestamp),
)

GPU_METRICS = (
    MetricSpec("cgpu_gpu_info", "info", GPU_LABELS,
               "A GPU managed by cgpu_km, with its product name (value 1).",
               lambda g: {"name": g.name}, ("name",)),
    MetricSpec("cgpu_gpu_memory_total_bytes", "gauge", GPU_LABELS,
               "Total memory of the GPU.", lambda g: g.memory_total_bytes),
    MetricSpec("cgpu_gpu_memory_used_bytes", "gauge", GPU_LABELS,
               "Memory in use on the GPU, all processes.", lambda g: g.memory_used_bytes),
    MetricSpec("cgpu_gpu_utilization_ratio", "gauge", GPU_LABELS,
               "Fraction of the last seconds (up to 5) the GPU ran managed containers' kernels.",
               lambda g: g.utilization),
    MetricSpec("cgpu_gpu_policy", "gauge", GPU_LABELS,
               "Scheduling policy (0 fair-share, 1 preemptive, 2 weight-based preemptive, "
               "3 fixed, 4 soft, 5 native).", lambda g: g.policy),
    MetricSpec("cgpu_gpu_max_inst", "gauge", GPU_LABELS,
               "Most containers on the GPU, and the sum of weights it shares out.",
               lambda g: g.max_inst),
    MetricSpec("cgpu_gpu_free_weight", "gauge", GPU_LABELS,
               "max_inst minus the sum of the weights of the GPU's containers.",
               lambda g: g.free_weight),
    MetricSpec("cgpu_gpu_prio_ratio", "gauge", GPU_LABELS,
               "Most of the GPU an active high-priority container may take.",
               lambda g: _ratio(g.prio_ratio)),
)

CONTAINER_METRICS = (
    MetricSpec("cgpu_container_memory_used_bytes", "gauge", CONTAINER_LABELS,
               "GPU memory used by the container's processes.", lambda c: c.memory_used_bytes),
    MetricSpec("cgpu_container_memory_limit_bytes", "gauge", CONTAINER_LABELS,
               "GPU memory limit of the container (the device total when it has the whole GPU).",
               lambda c: c.memory_limit_bytes),
    MetricSpec("cgpu_container_gpu_time_seconds_total", "counter", CONTAINER_LABELS,
               "GPU busy time used by the container's kernels.", lambda c: c.gpu_time_seconds),
    MetricSpec("cgpu_container_target_share_ratio", "gauge", CONTAINER_LABELS,
               "Share of GPU time the scheduler gives the container now.",
               lambda c: c.target_share),
    MetricSpec("cgpu_container_utilization_ratio", "gauge", CONTAINER_LABELS,
               "Fraction of the last seconds (up to 5) the GPU ran the container's kernels.",
               lambda c: c.utilization),
    MetricSpec("cgpu_container_gate_wait_seconds_total", "counter", CONTAINER_LABELS,
               "Time the container's kernel launches waited at its closed gate, summed over "
               "its processes.",
               lambda c: c.gate_wait_seconds),
    MetricSpec("cgpu_container_oom_events_total", "counter", CONTAINER_LABELS,
               "Allocations refused, or processes stopped, for exceeding the memory limit.",
               lambda c: c.oom_events),
    MetricSpec("cgpu_container_weight", "gauge", CONTAINER_LABELS,
               "Scheduling weight of the container.", lambda c: c.weight),
    MetricSpec("cgpu_container_highprio", "gauge", CONTAINER_LABELS,
               "1 when the container has high priority, else 0.", lambda c: int(c.highprio)),
    MetricSpec("cgpu_container_util_limit_ratio", "gauge", CONTAINER_LABELS,
               "Cap on the container's share of GPU time (0: none).",
               lambda c: _ratio(c.util_limit)),
    MetricSpec("cgpu_container_processes", "gauge", CONTAINER_LABELS,
               "Processes of the container using memory on the GPU.",
               lambda c: len(c.processes)),
    MetricSpec("cgpu_container_unmanaged_processes", "gauge", CONTAINER_LABELS,
               "Processes of the container on the GPU that bypassed libcgpu (no process "
               "slot): counted against its memory limit, not gated.",
               lambda c: sum(not p.managed for p in c.processes)),
    MetricSpec("cgpu_container_bypass_stops_total", "counter", CONTAINER_LABELS,
               "Processes of the container stopped for holding GPU memory without libcgpu "
               "(policies 0-4, unless the daemon only reports them).",
               lambda c: c.bypass_stops),
    MetricSpec("cgpu_container_overuse_stops_total", "counter", CONTAINER_LABELS,
               "Processes of the container stopped for GPU time beyond its grants, as NVML's "
               "per-process samples show it (policies 0-4, unless the daemon only reports "
               "them).",
               lambda c: c.overuse_stops),
    MetricSpec("cgpu_container_audits_total", "counter", CONTAINER_LABELS,
               "Quiet spans the scheduler gave the busy container, in which the driver must "
               "see none of its processes run.",
               lambda c: c.audits),
)

METRICS = DAEMON_METRICS + GPU_METRICS + CONTAINER_METRICS


def _family(spec: MetricSpec) -> Metric:
    if spec.kind == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
    if spec.kind == "info":
        return InfoMetricFamily(spec.name.removesuffix("_info"), spec.help, labels=spec.labels)
    return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)


def _build(spec: MetricSpec, subjects: Iterable[tuple[list[str], Any]]) -> Metric:
    family = _family(spec)
    for labels, subject in subjects:
        value = spec.value(subject)
        if value is None:
            continue
        if isinstance(family, InfoMetricFamily):
            assert isinstance(value, dict)
            family.add_metric(labels, value)
        else:
            assert not isinstance(value, dict)
            family.add_metric(labels, float(value))  # type: ignore[attr-defined]
    return family


def snapshot_metrics(snapshot: Snapshot) -> Iterator[Metric]:
    """Every metric family for one snapshot (families without samples included)."""
    uuids = {gpu.index: gpu.uuid for gpu in snapshot.gpus}
    daemon: list[tuple[list[str], Any]] = [([], snapshot)]
    gpus = [([str(g.index), g.uuid], g) for g in snapshot.gpus]
    containers = [([str(c.gpu), uuids.get(c.gpu, ""), c.name], c) for c in snapshot.containers]
    for specs, subjects in ((DAEMON_METRICS, daemon), (GPU_METRICS, gpus),
                            (CONTAINER_METRICS, containers)):
        for spec in specs:
            yield _build(spec, subjects)


class SnapshotHolder:
    """The latest snapshot: the daemon swaps one in, scrapes read it (any thread)."""

    def __init__(self, snapshot: Snapshot | None = None) -> None:
        self._snapshot = snapshot
        self._lock = threading.Lock()

    def swap(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._snapshot = snapshot

    def __call__(self) -> Snapshot | None:
        with self._lock:
            return self._snapshot


class SnapshotCollector(Collector):
    """Collector over a snapshot provider; nothing is exported before the first snapshot."""

    def __init__(self, provider: SnapshotProvider) -> None:
        self._provider = provider

    def collect(self) -> Iterator[Metric]:
        snapshot = self._provider()
        if snapshot is not None:
            yield from snapshot_metrics(snapshot)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families depend on the snapshot: collect at scrape time only


def make_registry(provider: SnapshotProvider) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(provider))
    return registry


class ListenAddress(NamedTuple):
    host: str
    port: int


def parse_listen(text: str) -> ListenAddress | None:
    """`HOST:PORT` (`[::1]:9400` for IPv6) or `off` (None); ValueError names the problem."""
    value = text.strip()
    if value.lower() == "off":
        return None
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"metrics address {text!r}: expected HOST:PORT or 'off'")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"metrics address {text!r}: unbalanced '[' in host")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"metrics address {text!r}: write an IPv6 host as [HOST]:PORT")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"metrics address {text!r}: port must be 0..65535")
    return ListenAddress(host, int(port_text))


class MetricsServer:
    """A running `/metrics` HTTP server thread; `port` is the bound port."""

    def __init__(self, host: str, port: int, provider: SnapshotProvider) -> None:
        self.registry = make_registry(provider)
        self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.host = host
        self.port = int(self._httpd.server_address[1])

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve_metrics(host: str, port: int, provider: SnapshotProvider) -> MetricsServer:
    """Serve `/metrics` for `provider` on HOST:PORT (port 0: any free one) in a thread."""
    return MetricsServer(host, port, provider)
