"""What a host holds that no image may reach: an empty folder and a root-only file."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostFiles:
    """A sentinel folder that must stay empty, a 0600 root file that must stay as it is."""

    sentinel: Path
    secret: Path
    content: str

    def untouched(self) -> None:
        assert list(self.sentinel.iterdir()) == []
        assert self.secret.read_text() == self.content
        found = self.secret.stat()
        assert (found.st_uid, found.st_mode & 0o7777) == (0, 0o600)


@contextlib.contextmanager
def host_files() -> Iterator[HostFiles]:
    folders = [Path(tempfile.mkdtemp(prefix=f"cgpu-{what}-")) for what in ("sentinel", "secret")]
    try:
        sentinel, secret_dir = folders
        secret = secret_dir / "secret"
        content = f"host-secret-{secrets.token_hex(8)}"
        secret.write_text(content + "\n")
        secret.chmod(0o600)
        yield HostFiles(sentinel, secret, content + "\n")
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
