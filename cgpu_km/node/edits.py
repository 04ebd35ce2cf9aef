"""Reversible edits of a nested configuration document (parsed JSON or TOML).

`apply` sets values at key paths and returns, for each path it touched, an
`Edit` with the value before (or its absence) and after, tables it had to
create included. `undo` walks them back newest first, restoring a value only
where the document still holds what the edit wrote, so what someone changed
since is kept. For every document d and paths p: undo(apply(d, p)) == d.
Pure functions; edits serialize to JSON for the install record.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Doc = dict[str, Any]
Path = tuple[str, ...]


class EditError(ValueError):
    """A key on the path holds something that is not a table."""


@dataclass(frozen=True)
class Edit:
    path: Path
    existed: bool
    before: Any  # None when it did not exist
    after: Any

    def to_json(self) -> dict[str, Any]:
        return {"path": list(self.path), "existed": self.existed, "before": self.before,
                "after": self.after}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Edit:
        return cls(tuple(str(k) for k in data["path"]), bool(data["existed"]),
                   data.get("before"), data.get("after"))


def get(doc: Doc, path: Path) -> tuple[bool, Any]:
    """(whether `path` exists, its value)."""
    node: Any = doc
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def _table(doc: Doc, path: Path) -> Doc:
    node: Any = doc
    for depth, key in enumerate(path):
        node = node[key]
        if not isinstance(node, dict):
            raise EditError(f"{'.'.join(path[:depth + 1])} is not a table")
    assert isinstance(node, dict)
    return node


def apply(doc: Doc, sets: Sequence[tuple[Path, Any]]) -> tuple[Doc, list[Edit]]:
    """`doc` with each path set to its value, and the edits that did it."""
    result = copy.deepcopy(doc)
    edits: list[Edit] = []
    for path, value in sets:
        for depth in range(1, len(path)):
            parent = _table(result, path[:depth - 1])
            key = path[depth - 1]
            if key not in parent:
                parent[key] = {}
                edits.append(Edit(path[:depth], False, None, {}))
            elif not isinstance(parent[key], dict):
                raise EditError(f"{'.'.join(path[:depth])} is not a table")
        parent = _table(result, path[:-1])
        existed = path[-1] in parent
        edits.append(Edit(path, existed, copy.deepcopy(parent.get(path[-1])),
                          copy.deepcopy(value)))
        parent[path[-1]] = copy.deepcopy(value)
    return result, _final(edits)


def _final(edits: list[Edit]) -> list[Edit]:
    """Keep, for a path set twice, the first `before` and the last `after`;
    a table created and then filled reads as `{}` after only while empty."""
    merged: dict[Path, Edit] = {}
    order: list[Path] = []
    for edit in edits:
        if edit.path in merged:
            first = merged[edit.path]
            merged[edit.path] = Edit(edit.path, first.existed, first.before, edit.after)
        else:
            merged[edit.path] = edit
            order.append(edit.path)
    return [merged[path] for path in order]


def undo(doc: Doc, edits: Sequence[Edit]) -> Doc:
    """`doc` with `edits` walked back where it still holds what they wrote."""
    result = copy.deepcopy(doc)
    for edit in reversed(edits):
        present, value = get(result, edit.path)
        if not present or value != edit.after:
            continue
        parent_present, parent = get(result, edit.path[:-1]) if edit.path[:-1] else (True, result)
        if not parent_present or not isinstance(parent, dict):
            continue
        if edit.existed:
            parent[edit.path[-1]] = copy.deepcopy(edit.before)
        else:
            del parent[edit.path[-1]]
    return result
