"""A real HTTP scrape: promtool's linter, and a real Prometheus server querying what it scraped."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from cgpu_km.daemon.metrics import MetricsServer

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "cgpu_km-dashboard.json"
ABC = 'container="abc123def456"'


def test_scrape_is_text_exposition(scraped: str, metrics_server: MetricsServer) -> None:
    assert f"cgpu_container_memory_limit_bytes{{{ABC},gpu=\"0\"," in scraped
    assert "# TYPE cgpu_container_gpu_time_seconds_total counter" in scraped
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_server.port}/metrics") as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")


def test_promtool_check_metrics_passes(scraped: str, promtool: str) -> None:
    result = subprocess.run([promtool, "check", "metrics"], input=scraped, text=True,
                            capture_output=True, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_promtool_catches_a_bad_name(promtool: str) -> None:
    """The check above can fail: promtool does reject a counter without `_total`."""
    bad = "# HELP cgpu_x_seconds x\n# TYPE cgpu_x_seconds counter\ncgpu_x_seconds 1\n"
    result = subprocess.run([promtool, "check", "metrics"], input=bad, text=True,
                            capture_output=True, check=False)
    assert result.returncode != 0


def test_prometheus_scrapes_the_memory_limit(prometheus: Any) -> None:
    (sample,) = prometheus.vector(f"cgpu_container_memory_limit_bytes{{{ABC}}}")
    assert float(sample["value"][1]) == 6337173913
    assert sample["metric"] == {
        "__name__": "cgpu_container_memory_limit_bytes", "container": "abc123def456",
        "gpu": "0", "uuid": "GPU-5e1d0f6a-0000-4000-8000-000000000000",
        "instance": sample["metric"]["instance"], "job": "cgpu",
    }
    (up,) = prometheus.vector('up{job="cgpu"}')
    assert up["value"][1] == "1"


def dashboard_queries() -> list[str]:
    """Every PromQL expression in the dashboard: panel targets and variable queries."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*), *\w+\)", variable["definition"])
            assert inner, variable["definition"]
            exprs.append(inner.group(1))
    return exprs


def grafana_to_promql(expr: str) -> str:
    """Replace the dashboard's variables by what Grafana would substitute for 'All'."""
    return (expr.replace("$__rate_interval", "1m")
            .replace("$gpu", ".*").replace("$container", ".*"))


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset",
                "bool", "and", "or", "unless"}


def metric_names(expr: str) -> set[str]:
    """Identifiers in `expr` that name series (not functions, keywords, labels or strings)."""
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", bare)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", bare):
        rest = bare[match.end():].lstrip()
        if not rest.startswith("(") and match.group() not in PROMQL_WORDS:
            names.add(match.group())
    return names


def test_every_dashboard_query_names_an_exported_metric(
        metrics_server: MetricsServer) -> None:
    exported = {s.name for f in metrics_server.registry.collect() for s in f.samples}
    queries = dashboard_queries()
    assert len(queries) >= 15
    used: set[str] = set()
    for expr in queries:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exported, f"{expr!r} names {names - exported}, not exported"
        used |= names
    # The dashboard shows every per-container family and every per-GPU one.
    assert {n for n in exported if n.startswith(("cgpu_container_", "cgpu_gpu_"))} <= used


def test_metric_name_extraction() -> None:
    expr = 'rate(cgpu_x_total{gpu=~"$gpu"}[1m]) / on(gpu) cgpu_y_bytes - time()'
    assert metric_names(expr) == {"cgpu_x_total", "cgpu_y_bytes"}


def test_dashboard_queries_run_in_prometheus(prometheus: Any) -> None:
    # rate() needs two samples of a series: wait for the second scrape.
    prometheus.wait_for(lambda: prometheus.vector("count_over_time(cgpu_build_info[1m]) >= 2"),
                        "a second scrape")
    for expr in dashboard_queries():
        result = prometheus.vector(grafana_to_promql(expr))
        assert result, f"{expr!r} returned nothing"
