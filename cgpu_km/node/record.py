"""What an install changed on the node, so that uninstall puts it back byte for byte.

The record lives in `<state dir>/install.json`, the originals of the files
it replaced in `<state dir>/backup/`. For every path it wrote it keeps
whether something was there before (a file: its backup and mode; a symbolic
link: its target), the SHA-256 of what it wrote, and for shared engine
configurations the edits (cgpu_km.node.edits) that it made. Uninstall
restores the original when the path still holds what install wrote;
otherwise it takes cgpu's edits out of what is there now and keeps the rest.
A second install keeps the first one's originals.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cgpu_km.fileio import replace_file, replace_link
from cgpu_km.node.edits import Edit

RECORD_NAME = "install.json"
BACKUP_DIR = "backup"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Original:
    """What was at a path before the install."""

    kind: str  # "absent", "file" or "link"
    backup: str | None = None  # file: its copy, relative to the state dir
    mode: int = 0o644
    target: str | None = None  # link: where it pointed

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "backup": self.backup, "mode": self.mode,
                "target": self.target}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Original:
        return cls(kind=str(data["kind"]), backup=data.get("backup"),
                   mode=int(data.get("mode", 0o644)), target=data.get("target"))


@dataclass
class Record:
    """The install record of one node (see the module's docstring)."""

    state_dir: Path
    settings: dict[str, Any] = field(default_factory=dict)  # the install's options and layout
    originals: dict[str, Original] = field(default_factory=dict)
    written: dict[str, str] = field(default_factory=dict)  # path -> sha256 or "link:<target>"
    edits: dict[str, list[Edit]] = field(default_factory=dict)
    created_dirs: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)  # services enabled, prefix created

    @property
    def path(self) -> Path:
        return self.state_dir / RECORD_NAME

    @classmethod
    def load(cls, state_dir: Path) -> Record | None:
        try:
            data = json.loads((state_dir / RECORD_NAME).read_text())
        except FileNotFoundError:
            return None
        return cls(
            state_dir=state_dir, settings=dict(data.get("settings", {})),
            originals={k: Original.from_json(v) for k, v in data.get("originals", {}).items()},
            written=dict(data.get("written", {})),
            edits={k: [Edit.from_json(e) for e in v] for k, v in data.get("edits", {}).items()},
            created_dirs=list(data.get("created_dirs", [])), notes=dict(data.get("notes", {})))

    def save(self) -> None:
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = {"settings": self.settings,
                "originals": {k: v.to_json() for k, v in self.originals.items()},
                "written": self.written,
                "edits": {k: [e.to_json() for e in v] for k, v in self.edits.items()},
                "created_dirs": self.created_dirs, "notes": self.notes}
        replace_file(self.path, (json.dumps(data, indent=1) + "\n").encode(), 0o600)

    # --- before writing ---------------------------------------------------------

    def make_dirs(self, folder: Path) -> None:
        """Create `folder` and its missing parents, remembering which were new."""
        missing = []
        current = folder
        while not current.exists():
            missing.append(current)
            current = current.parent
        for new in reversed(missing):
            new.mkdir(mode=0o755)
            self.created_dirs.append(str(new))

    def remember(self, path: Path) -> None:
        """Keep what is at `path` now, unless an earlier install already did."""
        key = str(path)
        if key in self.originals:
            return
        if path.is_symlink():
            self.originals[key] = Original("link", target=os.readlink(path))
        elif path.is_file():
            backups = self.state_dir / BACKUP_DIR
            backups.mkdir(mode=0o700, parents=True, exist_ok=True)
            name = f"{len(self.originals):03d}-{path.name}"
            shutil.copyfile(path, backups / name)
            self.originals[key] = Original("file", backup=f"{BACKUP_DIR}/{name}",
                                           mode=stat.S_IMODE(path.stat().st_mode))
        elif path.exists():
            raise IsADirectoryError(f"{path} is a directory")
        else:
            self.originals[key] = Original("absent")
        self.save()

    def write(self, path: Path, data: bytes, mode: int = 0o644) -> None:
        self.make_dirs(path.parent)
        self.remember(path)
        original = self.originals[str(path)]
        replace_file(path, data, original.mode if original.kind == "file" else mode)
        self.written[str(path)] = sha256(data)
        self.save()

    def link(self, path: Path, target: Path) -> None:
        self.make_dirs(path.parent)
        self.remember(path)
        replace_link(path, target)
        self.written[str(path)] = f"link:{target}"
        self.save()

    # --- uninstall ----------------------------------------------------------------

    def holds_written(self, path: Path) -> bool:
        """Whether `path` still holds what the install wrote there."""
        wrote = self.written.get(str(path))
        if wrote is None:
            return False
        if wrote.startswith("link:"):
            return path.is_symlink() and os.readlink(path) == wrote[len("link:"):]
        try:
            return not path.is_symlink() and sha256(path.read_bytes()) == wrote
        except OSError:
            return False

    def restore(self, path: Path) -> None:
        """Put back what was at `path` before the install."""
        original = self.originals.get(str(path), Original("absent"))
        if original.kind == "absent":
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        elif original.kind == "link":
            assert original.target is not None
            replace_link(path, original.target)
        else:
            assert original.backup is not None
            replace_file(path, (self.state_dir / original.backup).read_bytes(), original.mode)
        self.written.pop(str(path), None)

    def remove_created_dirs(self) -> list[str]:
        """Remove the folders the install created, if empty; the ones left."""
        left = []
        for folder in reversed(self.created_dirs):
            try:
                os.rmdir(folder)
            except FileNotFoundError:
                continue
            except OSError:
                left.append(folder)
        self.created_dirs = []
        return left

    def forget(self) -> None:
        """Delete the record and the backups."""
        shutil.rmtree(self.state_dir / BACKUP_DIR, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.state_dir.rmdir()
