"""podman (and CRI-O): cgpu-hook in an OCI hooks directory (oci-hooks(5), schema 1.0.0).

A hook's `when` cannot match environment variables, so both hooks run
`always` and cgpu-hook decides from the container's environment. One file
per stage, as each stage calls the hook with its own argument.
"""

from __future__ import annotations

import json
from typing import Any

from cgpu_km.container.oci.spec import STAGES, HookCall

FILE_PREFIX = "cgpu-"


def hook_documents(hook: HookCall) -> dict[str, dict[str, Any]]:
    """File name -> hook document, one per stage."""
    return {f"{FILE_PREFIX}{stage}.json": {"version": "1.0.0", "hook": hook.entry(stage),
                                           "when": {"always": True}, "stages": [stage]}
            for stage in STAGES}


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2) + "\n"
