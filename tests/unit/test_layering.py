"""The imports between the daemon's layers point one way (docs/developer/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cgpu_km"
LAYERS = ("daemon", "dataplane", "sched", "tree")
# What each layer may import of the others.
ALLOWED = {
    "daemon": {"dataplane", "sched", "tree"},
    "dataplane": {"sched", "tree"},
    "sched": set(),
    "tree": set(),
}


def imported_layers(source: Path) -> set[str]:
    """The layers of `cgpu_km` that `source` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if len(parts) > 1 and parts[0] == "cgpu_km" and parts[1] in LAYERS:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_the_layers_beneath_it(layer: str) -> None:
    wrong = {
        str(source.relative_to(PACKAGE.parent)): sorted(imported - ALLOWED[layer] - {layer})
        for source in sorted((PACKAGE / layer).rglob("*.py"))
        if (imported := imported_layers(source)) - ALLOWED[layer] - {layer}
    }
    assert wrong == {}


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    source = tmp_path / "upward.py"
    source.write_text("from cgpu_km.daemon.edges import Plane\nimport cgpu_km.sched.slices\n")
    assert imported_layers(source) == {"daemon", "sched"}
