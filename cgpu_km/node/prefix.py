"""The self-contained prefix that a node runs cgpu_km from (default /opt/cgpu_km).

    venv/       cgpu_km and its dependencies, on an interpreter outside /root and
                /home (systemd's ProtectHome hides those), e.g. /usr/bin/python3
    lib/        libcgpu.so
    simgpu/     libcuda.so.1, libnvidia-ml.so.1, nvidia-smi, cuworkload
    systemd/    the service units
    VERSION

It is built from a source checkout without the network: the venv gets the
dependencies copied from the environment this program runs in (the same
Python version: their installed files, as listed in their RECORD) and
cgpu_km itself as a wheel built from the checkout (pip, no index). The
prefix is built beside the target and swapped in by a rename.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from cgpu_km import paths

PACKAGE = "cgpu_km"
SIMGPU_FILES = ("libcuda.so.1", "libnvidia-ml.so.1", "nvidia-smi", "cuworkload")
NAME_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


class PrefixError(Exception):
    """The prefix cannot be built; `str(error)` is one line."""


def checkout() -> Path | None:
    """The source checkout this program runs from, if it does."""
    root = paths.CHECKOUT
    return root if (root / "pyproject.toml").is_file() and (root / PACKAGE).is_dir() else None


def requirement_names(requires: Iterable[str]) -> list[tuple[str, bool]]:
    """(name, has a marker) of each requirement that is not an extra's."""
    found = []
    for text in requires:
        if "extra ==" in text.replace("extra==", "extra =="):
            continue
        match = NAME_RE.match(text)
        if match:
            found.append((match.group(1), ";" in text))
    return found


def dependency_closure(root: str) -> list[metadata.Distribution]:
    """The installed distributions that `root` needs, itself excluded."""
    seen: dict[str, metadata.Distribution] = {}
    pending = [(name, marker) for name, marker in
               requirement_names(metadata.distribution(root).requires or [])]
    while pending:
        name, has_marker = pending.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if has_marker:
                continue  # not for this Python or platform
            raise PrefixError(f"{name}, which {root} needs, is not installed here "
                              f"(run make setup)") from None
        seen[key] = dist
        pending.extend(requirement_names(dist.requires or []))
    return list(seen.values())


def copy_distribution(dist: metadata.Distribution, site: Path) -> None:
    """Copy an installed distribution's files (those inside site-packages)."""
    files = dist.files
    if files is None:
        raise PrefixError(f"{dist.metadata['Name']} has no RECORD: cannot copy it")
    for item in files:
        if item.parts and item.parts[0] == "..":
            continue  # scripts and data outside site-packages
        source = Path(str(dist.locate_file(item)))
        if not source.is_file():
            continue
        target = site / str(item)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or ["failed"])[-1]
        raise PrefixError(f"{what} failed: {detail}")


def python_version(python: str) -> str:
    result = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise PrefixError(f"cannot run {python}")
    return result.stdout.strip()


def build_venv(venv: Path, python: str, source: Path, scratch: Path) -> None:
    """A venv at `venv` (final path) with cgpu_km and its dependencies."""
    ours = f"{sys.version_info[0]}.{sys.version_info[1]}"
    theirs = python_version(python)
    if theirs != ours:
        raise PrefixError(f"{python} is Python {theirs}, this environment {ours}: "
                          "pass --python with a Python " + ours)
    run([python, "-m", "venv", "--without-pip", str(venv)], f"creating the venv {venv}")
    found = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import sysconfig; print(sysconfig.get_path('purelib'))"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise PrefixError(f"the new venv {venv} does not run")
    site = Path(found.stdout.strip())
    for dist in dependency_closure(PACKAGE):
        copy_distribution(dist, site)
    wheels = scratch / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(wheels), str(source)], "building the cgpu_km wheel")
    built = sorted(wheels.glob("cgpu_km-*.whl"))
    if not built:
        raise PrefixError("building the cgpu_km wheel made no wheel")
    run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--quiet", "--no-deps", "--no-index", str(built[-1])], "installing cgpu_km")
    shutil.rmtree(source / "build", ignore_errors=True)


def copy_payload(target: Path, source: Path) -> None:
    """libcgpu, simgpu, the units and VERSION from a built checkout."""
    wanted = [source / "libcgpu" / "libcgpu.so", *(source / "simgpu" / f for f in SIMGPU_FILES)]
    missing = [str(p.relative_to(source)) for p in wanted if not p.is_file()]
    if missing:
        raise PrefixError(f"not built: {', '.join(missing)} (run make build)")
    (target / "lib").mkdir(parents=True)
    shutil.copy2(source / "libcgpu" / "libcgpu.so", target / "lib" / "libcgpu.so")
    (target / "simgpu").mkdir()
    for name in SIMGPU_FILES:
        shutil.copy2(source / "simgpu" / name, target / "simgpu" / name)
    (target / "systemd").mkdir()
    for unit in sorted((source / "systemd").glob("*.service")):
        shutil.copy2(unit, target / "systemd" / unit.name)
    (target / "VERSION").write_text(metadata.version(PACKAGE) + "\n")


def build_prefix(prefix: Path, python: str) -> None:
    """Build the prefix from this checkout beside `prefix`, then swap it in."""
    source = checkout()
    if source is None:
        raise PrefixError("not running from a source checkout: nothing to install from")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    new = prefix.with_name(prefix.name + ".new")
    old = prefix.with_name(prefix.name + ".old")
    for leftover in (new, old):
        shutil.rmtree(leftover, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="cgpu-node-") as scratch:
        try:
            new.mkdir(mode=0o755)
            copy_payload(new, source)
            # A venv knows its own path: build it where it will be, then move the rest in.
            if prefix.exists():
                prefix.rename(old)
            new.rename(prefix)
            build_venv(prefix / "venv", python, source, Path(scratch))
        except BaseException:
            shutil.rmtree(prefix if not new.exists() else new, ignore_errors=True)
            if old.exists():
                shutil.rmtree(prefix, ignore_errors=True)
                old.rename(prefix)
            raise
    shutil.rmtree(old, ignore_errors=True)


def default_python() -> str:
    """An interpreter outside /root and /home for the venv."""
    for candidate in ("/usr/bin/python3", sys.executable):
        if Path(candidate).exists():
            return candidate
    return sys.executable
