"""podman (and CRI-O): cgpu-hook in an OCI hooks directory (oci-hooks(5), schema 1.0.0).

A hook's `when` cannot match environment variables, so both hooks run
`always` and cgpu-hook decides from the container's environment. One file
per stage, as each stage calls the hook with its own argument. podman
passes the hooks to its runtime with no wrapper in front, so the install
picks the start stage: createRuntime when every runtime podman may use
lists it in `features`, else prestart (`start_for`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from cgpu_km.container.oci.spec import (
    CREATE_RUNTIME,
    POSTSTOP,
    PRESTART,
    START_STAGES,
    HookCall,
    start_stage,
)

FILE_PREFIX = "cgpu-"
RUNTIMES = ("crun", "runc")  # the runtimes podman looks for


def file_name(stage: str) -> str:
    return f"{FILE_PREFIX}{stage}.json"


# Every name this install may have written, for replacing an older choice.
FILE_NAMES = tuple(file_name(stage) for stage in (*START_STAGES, POSTSTOP))


def start_for(runtime_hooks: Sequence[Collection[str] | None]) -> str:
    """createRuntime when there are runtimes and each lists it, else prestart."""
    stages = {start_stage(hooks) for hooks in runtime_hooks}
    return CREATE_RUNTIME if stages == {CREATE_RUNTIME} else PRESTART


def hook_documents(hook: HookCall, start: str) -> dict[str, dict[str, Any]]:
    """File name -> hook document, for `start` and poststop."""
    if start not in START_STAGES:
        raise ValueError(f"{start!r} is not a start stage ({', '.join(START_STAGES)})")
    return {file_name(stage): {"version": "1.0.0", "hook": hook.entry(stage),
                               "when": {"always": True}, "stages": [stage]}
            for stage in (start, POSTSTOP)}


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2) + "\n"
