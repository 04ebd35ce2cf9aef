"""Files replaced whole: written beside their target, then renamed over it,
so a reader (or a crash) sees the old content or the new, never a mix."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


class FileError(Exception):
    """A file could not be read as expected; `str(error)` names the file."""


def replace_file(path: Path, data: bytes | str, mode: int = 0o644) -> None:
    """Replace `path` with `data`, with permission bits `mode`."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def replace_link(path: Path, target: Path | str) -> None:
    """Make `path` a symbolic link to `target`, whatever it was before."""
    temporary = path.with_name(f".{path.name}.cgpu-link")
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    temporary.symlink_to(target)
    os.replace(temporary, path)


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or FileError saying why not."""
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise FileError(f"cannot read {path}: {error.strerror}") from None
    except ValueError as error:
        raise FileError(f"{path} is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise FileError(f"{path} is not a JSON object")
    return data
