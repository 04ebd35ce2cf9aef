"""Which container holds a tree id: the hook's record of full OCI ids.

The tree knows a container by the first 12 characters of its OCI id. At
the container's start (the createRuntime or prestart hook) the hook records
the full id in `<claim dir>/<id12>` ($CGPU_HOOK_STATE_DIR, else
/run/cgpu_km-hook), and at poststop it removes
only what the container holding that record registered. This makes a second
start of the same container idempotent: when an engine starts a container
again without having run its poststop (dockerd or containerd was killed),
the new start finds its own record and replaces the old registration.
A different container whose id shares the 12 characters is refused while
the holder is registered, and its poststop leaves the holder alone.
"""

from __future__ import annotations

import contextlib
import enum
import os
from pathlib import Path

from cgpu_km.fileio import replace_file

CLAIM_DIR_ENV = "CGPU_HOOK_STATE_DIR"
DEFAULT_CLAIM_DIR = "/run/cgpu_km-hook"


class Claim(enum.Enum):
    NEW = "new"  # nobody holds the id: register
    TAKE_OVER = "take over"  # this container held it before: replace its registration
    REFUSE = "refuse"  # another registered container holds it


def decide(recorded: str | None, container_id: str, registered: bool) -> Claim:
    """What the start does with a tree id, from the record and the tree."""
    if recorded == container_id:
        return Claim.TAKE_OVER
    if recorded is None or not registered:
        return Claim.NEW
    return Claim.REFUSE


def owns(recorded: str | None, container_id: str) -> bool:
    """Whether poststop of `container_id` may remove the tree id's registration
    (no record: registered by an older hook, so yes)."""
    return recorded is None or recorded == container_id


def claim_dir() -> Path:
    return Path(os.environ.get(CLAIM_DIR_ENV) or DEFAULT_CLAIM_DIR)


def read(id12: str, folder: Path | None = None) -> str | None:
    try:
        return ((folder or claim_dir()) / id12).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def write(id12: str, container_id: str, folder: Path | None = None) -> None:
    """Record the holder atomically (a folder only root can enter)."""
    target = folder or claim_dir()
    target.mkdir(mode=0o700, parents=True, exist_ok=True)
    replace_file(target / id12, container_id + "\n", 0o600)


def drop(id12: str, folder: Path | None = None) -> None:
    """Forget the record; a missing one is fine."""
    with contextlib.suppress(FileNotFoundError):
        ((folder or claim_dir()) / id12).unlink()
