"""Generate the docs' node tables from the node table.

`python -m cgpu_km.tree.doctable` rewrites, in every page of `PAGES`, the
lines between `BEGIN` and `END` with `render()`; `--check` only reports the
pages that are stale (exit status 1).  tests/unit/test_node_table.py runs the
check, so the docs cannot drift from `cgpu_km/tree/nodes.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cgpu_km.tree.nodes import MAX_INST, NODES, U64_MAX, Kind, Level, Node

REPO = Path(__file__).resolve().parents[2]
PAGES = (REPO / "docs" / "design.md", REPO / "docs" / "operator" / "control-tree.md")
BEGIN = "<!-- nodes: generated from cgpu_km/tree/nodes.py by python -m cgpu_km.tree.doctable -->"
END = "<!-- end of nodes -->"

_PREFIX = {Level.ROOT: "", Level.GPU: "<gpu>/", Level.CONTAINER: "<gpu>/<ctr>/"}


def _number(value: int) -> str:
    if value == MAX_INST:
        return "`max_inst`"
    return "`2^64-1`" if value == U64_MAX else f"`{value}`"


def _mode(node: Node) -> str:
    return ("r" if node.mode & 0o444 else "") + ("w" if node.writable else "")


def row(node: Node) -> str:
    """One table row: path, mode, range and initial value (value nodes), doc line."""
    valued = node.kind is Kind.VALUE
    span = f"{_number(node.minimum)}..{_number(node.maximum)}" if valued else ""
    initial = _number(node.initial) if valued else ""
    path = f"`{_PREFIX[node.level]}{node.name}`"
    return f"| {path} | {_mode(node)} | {span} | {initial} | {node.doc} |"


def render() -> str:
    """The table, between its markers."""
    lines = [BEGIN, "| node | mode | range | initial | what it holds |",
             "| --- | --- | --- | --- | --- |", *(row(n) for n in NODES), END]
    return "\n".join(lines)


def replace(text: str) -> str:
    """`text` with its generated table made current; ValueError without the markers."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError("no generated node table (its markers are missing)")
    return text[:start] + render() + text[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--check"]):
        print("usage: python -m cgpu_km.tree.doctable [--check]", file=sys.stderr)
        return 2
    stale = []
    for page in PAGES:
        text = page.read_text()
        fresh = replace(text)
        if fresh != text:
            stale.append(page)
            if not args:
                page.write_text(fresh)
    for page in stale:
        verb = "stale" if args else "rewritten"
        print(f"{page.relative_to(REPO)}: node table {verb}", file=sys.stderr)
    return 1 if stale and args else 0


if __name__ == "__main__":
    sys.exit(main())
