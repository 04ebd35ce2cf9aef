"""podman's hook files: which start stage, and one file per stage."""

from __future__ import annotations

import pytest

from cgpu_km.container.oci.spec import HookCall
from cgpu_km.node.podmanhooks import hook_documents, start_for

ALL = frozenset({"prestart", "createRuntime", "createContainer", "startContainer",
                 "poststart", "poststop"})
OLD = frozenset({"prestart", "poststart", "poststop"})


@pytest.mark.parametrize(("runtimes", "stage"), [
    ([ALL], "createRuntime"),
    ([ALL, ALL], "createRuntime"),
    ([ALL, OLD], "prestart"),  # podman may pick either: the one both run
    ([ALL, None], "prestart"),  # one cannot tell
    ([None], "prestart"),
    ([], "prestart"),  # no runtime found
])
def test_createruntime_only_when_every_runtime_lists_it(
        runtimes: list[frozenset[str] | None], stage: str) -> None:
    assert start_for(runtimes) == stage


@pytest.mark.parametrize("start", ["createRuntime", "prestart"])
def test_one_file_per_stage_always_run(start: str) -> None:
    hook = HookCall(path="/usr/local/bin/cgpu-hook")
    documents = hook_documents(hook, start)
    assert documents == {
        f"cgpu-{start}.json": {"version": "1.0.0", "hook": hook.entry(start),
                               "when": {"always": True}, "stages": [start]},
        "cgpu-poststop.json": {"version": "1.0.0", "hook": hook.entry("poststop"),
                               "when": {"always": True}, "stages": ["poststop"]}}
    with pytest.raises(ValueError, match="is not a start stage"):
        hook_documents(hook, "poststart")
