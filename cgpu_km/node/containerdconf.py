"""containerd's `config.toml`: the CRI runtime `cgpu` (runc with the wrapper as `BinaryName`).

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.cgpu]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.cgpu.options]
        BinaryName = "/usr/local/bin/cgpu-container-runtime"

The new runtime copies the `runc` runtime's settings (so `SystemdCgroup` and
the like match the kubelet's). With `default=True` it becomes the CRI's
`default_runtime_name`; with `nvidia=True` an `nvidia` runtime (as NVIDIA's
toolkit writes it) runs the wrapper, which runs its old `BinaryName`
(`nvidia_program`). Config versions 2 (containerd 1.x) and 3 (2.x). Pure
functions over the parsed document; reversed with cgpu_km.node.edits.undo.
"""

from __future__ import annotations

import copy
import tomllib
from typing import Any

import tomli_w

from cgpu_km.node.edits import Doc, Edit, Path, apply, get

RUNTIME = "cgpu"
NVIDIA = "nvidia"
RUNC_V2 = "io.containerd.runc.v2"
CRI_TABLES: dict[int, Path] = {
    2: ("plugins", "io.containerd.grpc.v1.cri", "containerd"),
    3: ("plugins", "io.containerd.cri.v1.runtime", "containerd"),
}


class ContainerdConfError(ValueError):
    """config.toml cannot be edited; `str(error)` is one line."""


def parse(text: str, new_version: int = 2) -> Doc:
    """config.toml's text; an empty file reads as `version = new_version`."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ContainerdConfError(f"not TOML: {error}") from None
    if not doc:
        return {"version": new_version}
    version = doc.get("version", 1)
    if version not in CRI_TABLES:
        raise ContainerdConfError(f"config version {version} is not supported (2 or 3; "
                                  "migrate it with `containerd config migrate`)")
    return doc


def render(doc: Doc) -> str:
    return tomli_w.dumps(doc)


def _runtimes(doc: Doc) -> Path:
    return (*CRI_TABLES[int(doc.get("version", 2))], "runtimes")


def nvidia_program(doc: Doc, wrapper: str) -> str | None:
    """The BinaryName of the CRI `nvidia` runtime, unless that is the wrapper."""
    _, name = get(doc, (*_runtimes(doc), NVIDIA, "options", "BinaryName"))
    return name if isinstance(name, str) and name and name != wrapper else None


def register(doc: Doc, wrapper: str, *, default: bool, nvidia: bool) -> tuple[Doc, list[Edit]]:
    """`doc` with the CRI runtime `cgpu`, and the edits that did it."""
    runtimes = _runtimes(doc)
    _, runc = get(doc, (*runtimes, "runc"))
    runtime: dict[str, Any] = copy.deepcopy(runc) if isinstance(runc, dict) else {}
    runtime.setdefault("runtime_type", RUNC_V2)
    options = runtime.get("options")
    runtime["options"] = {**(options if isinstance(options, dict) else {}),
                          "BinaryName": wrapper}
    sets: list[tuple[Path, Any]] = [((*runtimes, RUNTIME), runtime)]
    if default:
        sets.append(((*runtimes[:-1], "default_runtime_name"), RUNTIME))
    present, _ = get(doc, (*runtimes, NVIDIA))
    if nvidia and present:
        sets.append(((*runtimes, NVIDIA, "options", "BinaryName"), wrapper))
    return apply(doc, sets)
