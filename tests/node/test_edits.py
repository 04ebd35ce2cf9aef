"""Reversible document edits, and docker's and containerd's registrations."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cgpu_km.node import containerdconf, dockerconf
from cgpu_km.node.edits import EditError, apply, undo

KEY = st.sampled_from(["runtimes", "cgpu", "nvidia", "default-runtime", "path", "a"])
LEAF = st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=4)
DOC = st.recursive(LEAF, lambda inner: st.dictionaries(KEY, inner, max_size=3), max_leaves=10)
DOCS = st.dictionaries(KEY, DOC, max_size=4)
SETS = st.lists(st.tuples(st.lists(KEY, min_size=1, max_size=3).map(tuple), DOC), max_size=4)


@given(DOCS, SETS)
def test_undo_of_apply_is_the_document(doc: dict[str, Any],
                                       sets: list[tuple[tuple[str, ...], Any]]) -> None:
    try:
        edited, edits = apply(doc, sets)
    except EditError:
        return
    assert undo(edited, edits) == doc


@given(DOCS.filter(lambda d: isinstance(d.get("runtimes", {}), dict)), st.text(max_size=4))
def test_undo_keeps_what_changed_since(doc: dict[str, Any], value: str) -> None:
    edited, edits = apply(doc, [(("runtimes", "cgpu"), {"path": "/w"})])
    edited["runtimes"]["mine"] = value  # someone added a runtime after the install
    restored = undo(edited, edits)
    assert restored["runtimes"]["mine"] == value
    assert "cgpu" not in restored["runtimes"] or doc.get("runtimes", {}).get("cgpu") \
        == restored["runtimes"]["cgpu"]


def test_docker_registration() -> None:
    doc = dockerconf.parse('{"runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-'
                           'runtime", "runtimeArgs": ["--debug"]}}, "default-runtime": "nvidia"}')
    assert dockerconf.nvidia_program(doc, "/w") == "/usr/bin/nvidia-container-runtime"
    plain, _ = dockerconf.register(doc, "/w", default=False, nvidia=False)
    assert plain["runtimes"]["cgpu"] == {"path": "/w"}
    assert plain["default-runtime"] == "nvidia"
    full, edits = dockerconf.register(doc, "/w", default=True, nvidia=True)
    assert full["runtimes"]["nvidia"] == {"path": "/w", "runtimeArgs": ["--debug"]}
    assert full["default-runtime"] == "cgpu"
    assert dockerconf.nvidia_program(full, "/w") is None
    assert undo(full, edits) == doc
    assert dockerconf.parse("") == {}


@pytest.mark.parametrize(("text", "message"), [
    ("{", "not JSON: "), ("[]", "not a JSON object"),
    ('{"runtimes": []}', '"runtimes" is not an object'),
])
def test_docker_bad_files(text: str, message: str) -> None:
    with pytest.raises(dockerconf.DockerConfError, match=f"^{message}"):
        dockerconf.parse(text)


def test_containerd_registration_copies_runc_and_takes_nvidia() -> None:
    text = """version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = true
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
    BinaryName = "/usr/bin/nvidia-container-runtime"
"""
    doc = containerdconf.parse(text)
    assert containerdconf.nvidia_program(doc, "/w") == "/usr/bin/nvidia-container-runtime"
    edited, edits = containerdconf.register(doc, "/w", default=True, nvidia=True)
    reread = tomllib.loads(containerdconf.render(edited))
    cri = reread["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert cri["runtimes"]["cgpu"] == {"runtime_type": "io.containerd.runc.v2",
                                       "options": {"SystemdCgroup": True, "BinaryName": "/w"}}
    assert cri["runtimes"]["nvidia"]["options"]["BinaryName"] == "/w"
    assert cri["runtimes"]["runc"]["options"] == {"SystemdCgroup": True}
    assert cri["default_runtime_name"] == "cgpu"
    assert undo(edited, edits) == doc


def test_containerd_versions() -> None:
    assert containerdconf.parse("", new_version=3) == {"version": 3}
    v3, _ = containerdconf.register({"version": 3}, "/w", default=False, nvidia=True)
    assert v3["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"] == {
        "cgpu": {"runtime_type": "io.containerd.runc.v2", "options": {"BinaryName": "/w"}}}
    with pytest.raises(containerdconf.ContainerdConfError, match="config version 1 is not"):
        containerdconf.parse('[plugins.cri]\nx = 1\n')
    with pytest.raises(containerdconf.ContainerdConfError, match=r"^not TOML: "):
        containerdconf.parse("version = ")
