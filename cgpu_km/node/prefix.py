"""The self-contained prefix that a node runs cgpu_km from (default /opt/cgpu_km).

    venv/       cgpu_km and its dependencies, on an interpreter outside /root,
                /home and /run/user (the units' ProtectHome=yes hides those; install
                refuses them), e.g. /usr/bin/python3
    lib/        libcgpu.so
    simgpu/     libcuda.so.1, libnvidia-ml.so.1, nvidia-smi, cuworkload
    systemd/    the service units
    VERSION

It is built from a source checkout without the network: the venv gets the
dependencies copied from the environment this program runs in (the same
Python version: their installed files, as listed in their RECORD) and
cgpu_km itself as a wheel built from the checkout (pip, no index), or one
given with `--wheel`. The
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


def check_wheel(wheel: Path) -> None:
    """A wheel of cgpu_km given with `--wheel`, checked before anything is written."""
    if not wheel.name.startswith(f"{PACKAGE}-") or wheel.suffix != ".whl":
        raise PrefixError(f"{wheel}: not a {PACKAGE} wheel ({PACKAGE}-*.whl)")
    if not wheel.is_file():
        raise PrefixError(f"{wheel}: no such file")


# What the wheel is built from (pyproject.toml names the README).
WHEEL_SOURCES = ("pyproject.toml", "README.md", PACKAGE, "fuse_fs")


def build_wheel(source: Path, scratch: Path) -> Path:
    """A wheel of cgpu_km built from a copy of the checkout's sources in `scratch`
    (pip, no index): the build writes nothing into the checkout, which may be
    read-only."""
    copy = scratch / "source"
    copy.mkdir(parents=True)
    for name in WHEEL_SOURCES:
        if (source / name).is_dir():
            shutil.copytree(source / name, copy / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source / name, copy / name)
    wheels = scratch / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(wheels), str(copy)], "building the cgpu_km wheel")
    built = sorted(wheels.glob("cgpu_km-*.whl"))
    if not built:
        raise PrefixError("building the cgpu_km wheel made no wheel")
    return built[-1]


def build_venv(venv: Path, python: str, source: Path, scratch: Path,
               wheel: Path | None = None) -> None:
    """A venv at `venv` (final path) with cgpu_km (from `wheel`, else built from
    the checkout) and its dependencies."""
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
    if wheel is None:
        wheel = build_wheel(source, scratch)
    run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--quiet", "--no-deps", "--no-index", str(wheel)], "installing cgpu_km")


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


def build_prefix(prefix: Path, python: str, wheel: Path | None = None) -> None:
    """Build the prefix from this checkout beside `prefix`, then swap it in; cgpu_km
    from `wheel` when given (a wheel built beforehand: no build on this node)."""
    source = checkout()
    if source is None:
        raise PrefixError("not running from a source checkout: nothing to install from")
    if wheel is not None:
        check_wheel(wheel)
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
            build_venv(prefix / "venv", python, source, Path(scratch), wheel)
        except BaseException:
            shutil.rmtree(prefix if not new.exists() else new, ignore_errors=True)
            if old.exists():
                shutil.rmtree(prefix, ignore_errors=True)
                old.rename(prefix)
            raise
    shutil.rmtree(old, ignore_errors=True)


# What ProtectHome=yes in the units hides from the services.
PROTECTED_HOME = (Path("/root"), Path("/home"), Path("/run/user"))


def hidden_from_units(path: Path) -> Path | None:
    """The folder of PROTECTED_HOME that holds `path` (links resolved), or None:
    a program or interpreter there cannot be executed by the units (203/EXEC)."""
    resolved = path.resolve()
    for folder in PROTECTED_HOME:
        if resolved == folder or folder in resolved.parents:
            return folder
    return None


def default_python() -> str:
    """An interpreter outside /root and /home for the venv."""
    for candidate in ("/usr/bin/python3", sys.executable):
        if Path(candidate).exists():
            return candidate
    return sys.executable
