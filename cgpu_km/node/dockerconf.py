"""Docker's `daemon.json`: the runtime `cgpu`, optionally the default, optionally `nvidia`.

    {"runtimes": {"cgpu": {"path": "/usr/local/bin/cgpu-container-runtime"}},
     "default-runtime": "cgpu"}                              # with default=True

With `nvidia=True` the name `nvidia` runs the wrapper too (its runtimeArgs
kept), so that `docker run --runtime=nvidia` works unchanged; the wrapper
then runs the program that the name ran before (`nvidia_program`), the
NVIDIA runtime. Pure functions over the parsed document; the edits are
reversed with cgpu_km.node.edits.undo.
"""

from __future__ import annotations

import json
from typing import Any

from cgpu_km.node.edits import Doc, Edit, Path, apply

RUNTIME = "cgpu"
NVIDIA = "nvidia"
DEFAULT_KEY = "default-runtime"


class DockerConfError(ValueError):
    """daemon.json cannot be edited; `str(error)` is one line."""


def parse(text: str) -> Doc:
    """daemon.json's text (empty: an empty document)."""
    if not text.strip():
        return {}
    try:
        doc = json.loads(text)
    except ValueError as error:
        raise DockerConfError(f"not JSON: {error}") from None
    if not isinstance(doc, dict):
        raise DockerConfError("not a JSON object")
    runtimes = doc.get("runtimes", {})
    if not isinstance(runtimes, dict):
        raise DockerConfError("\"runtimes\" is not an object")
    return doc


def render(doc: Doc) -> str:
    return json.dumps(doc, indent=4) + "\n"


def nvidia_program(doc: Doc, wrapper: str) -> str | None:
    """The program docker's `nvidia` runtime runs, unless that is the wrapper."""
    entry = doc.get("runtimes", {}).get(NVIDIA)
    path = entry.get("path") if isinstance(entry, dict) else None
    return path if isinstance(path, str) and path and path != wrapper else None


def register(doc: Doc, wrapper: str, *, default: bool, nvidia: bool) -> tuple[Doc, list[Edit]]:
    """`doc` with the wrapper registered, and the edits that did it."""
    sets: list[tuple[Path, Any]] = [(("runtimes", RUNTIME), {"path": wrapper})]
    if default:
        sets.append(((DEFAULT_KEY,), RUNTIME))
    if nvidia:
        entry: dict[str, Any] = {"path": wrapper}
        before = doc.get("runtimes", {}).get(NVIDIA)
        if isinstance(before, dict) and before.get("runtimeArgs"):
            entry["runtimeArgs"] = before["runtimeArgs"]
        sets.append((("runtimes", NVIDIA), entry))
    return apply(doc, sets)
