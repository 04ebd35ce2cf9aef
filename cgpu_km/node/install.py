"""The steps of `cgpu-node install` and `cgpu-node uninstall`.

install (each step recorded in cgpu_km.node.record):
  1. the prefix (cgpu_km.node.prefix), built from this checkout (cgpu_km
     from a wheel built beforehand with --wheel), on an interpreter that the
     hardened units can execute (not under /root, /home or /run/user);
  2. the programs linked into the bin folder (/usr/local/bin);
  3. the wrapper's configuration (/etc/cgpu_km/runtime.toml);
  4. docker: the runtime `cgpu` in daemon.json (optionally the default, or
     the name `nvidia`), then SIGHUP to a running dockerd, which reloads it;
  5. containerd: the CRI runtime `cgpu` in config.toml (a restart of
     containerd applies it); `ctr run --runc-binary` takes the wrapper as is;
  6. podman: cgpu-hook in /etc/containers/oci/hooks.d (read at every run), at
     createRuntime where podman's runtimes list it, else at prestart;
  7. the systemd units, enabled and started when systemd runs.
Every input is read and checked before anything is written. uninstall
walks the record back: the original files byte for byte where they still
hold what install wrote, else cgpu's entries taken out of what is there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cgpu_km import paths
from cgpu_km.container.envplan import ENFORCE
from cgpu_km.container.oci.runtime import runtime_hooks
from cgpu_km.container.oci.settings import (
    DEFAULT_PATH,
    DEFAULT_RUNTIMES,
    DEFAULT_STATE,
    Settings,
    render_settings,
)
from cgpu_km.container.oci.spec import HookCall, SimGpu
from cgpu_km.node import containerdconf, dockerconf, podmanhooks
from cgpu_km.node.edits import Doc, Edit, undo
from cgpu_km.node.prefix import PrefixError, build_prefix, checkout, hidden_from_units
from cgpu_km.node.record import Record

PROGRAMS = ("cgpu-hook", "cgpu-container-runtime", "cgpu-daemon", "cgpu-fuse", "cgpu-smi",
            "cgpu-run", "cgpu-node")
ENGINES = ("docker", "containerd", "podman")
UNIT_BIN = "/usr/local/bin/"

Say = Callable[[str], None]


class InstallError(Exception):
    """A bad input or a failed step; `str(error)` is one line."""


@dataclass(frozen=True)
class Layout:
    """Where things go on the node."""

    prefix: Path = Path("/opt/cgpu_km")
    bin_dir: Path = Path("/usr/local/bin")
    etc: Path = Path("/etc")
    state_dir: Path = Path("/var/lib/cgpu_km")

    @property
    def docker_config(self) -> Path:
        return self.etc / "docker" / "daemon.json"

    @property
    def containerd_config(self) -> Path:
        return self.etc / "containerd" / "config.toml"

    @property
    def hooks_dir(self) -> Path:
        return self.etc / "containers" / "oci" / "hooks.d"

    @property
    def runtime_config(self) -> Path:
        return self.etc / "cgpu_km" / "runtime.toml"

    @property
    def unit_dir(self) -> Path:
        return self.etc / "systemd" / "system"

    @property
    def wrapper(self) -> Path:
        return self.bin_dir / "cgpu-container-runtime"

    @property
    def hook(self) -> Path:
        return self.bin_dir / "cgpu-hook"


@dataclass(frozen=True)
class Options:
    engines: tuple[str, ...] = ENGINES
    docker_default: bool = False
    nvidia_name: bool = False
    tree_root: str | None = None
    simulate: str = "auto"
    simgpu_state: str = DEFAULT_STATE
    simgpu_devices: str = ""
    hook_env: tuple[str, ...] = ()  # more KEY=VALUE for the hook
    enforce: bool = False  # every container given a GPU is managed (CGPU_ENFORCE=1)
    services: bool = True
    build: bool = True
    python: str = sys.executable
    docker_pidfile: Path = Path("/var/run/docker.pid")
    wheel: Path | None = None  # cgpu_km's wheel, built beforehand (else built here)


# --- pure parts ---------------------------------------------------------------

def unit_text(text: str, bin_dir: Path) -> str:
    """A unit with its programs in `bin_dir` instead of /usr/local/bin."""
    return text.replace(UNIT_BIN, str(bin_dir).rstrip("/") + "/")


@dataclass(frozen=True)
class Parts:
    """Where the installed programs find libcgpu and simgpu."""

    libcgpu: Path
    simgpu: Path

    @classmethod
    def of(cls, prefix: Path) -> Parts:
        """The prefix's copies, else this environment's (an install with --no-build)."""
        if (prefix / "lib" / "libcgpu.so").is_file():
            return cls(prefix / "lib" / "libcgpu.so", prefix / "simgpu")
        return cls(paths.libcgpu(), paths.simgpu_dir())


def hook_call(parts: Parts, options: Options, hook: Path) -> HookCall:
    env = (f"PATH={DEFAULT_PATH}", f"CGPU_LIBCGPU={parts.libcgpu}",
           *((f"{ENFORCE}=1",) if options.enforce else ()), *options.hook_env)
    return HookCall(path=str(hook), root=options.tree_root, env=env)


def runtime_settings(parts: Parts, options: Options, hook: Path,
                     nvidia: list[str]) -> Settings:
    runtimes = tuple(dict.fromkeys([*nvidia, *DEFAULT_RUNTIMES]))
    return Settings(runtimes=runtimes, hook=hook_call(parts, options, hook),
                    simulate=options.simulate,
                    simgpu=SimGpu(folder=parts.simgpu, state=Path(options.simgpu_state)),
                    simgpu_devices=options.simgpu_devices)


def podman_hook_call(parts: Parts, options: Options, hook: Path) -> HookCall:
    """The hook as podman runs it: no wrapper in front, so with simgpu's
    environment when simulation is on (auto: the hook falls back by itself)."""
    if options.simulate != "on":
        return hook_call(parts, options, hook)
    return runtime_settings(parts, options, hook, []).hook_for(simulating=True)


# --- reading what is there ----------------------------------------------------

def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""
    except (OSError, UnicodeDecodeError) as error:
        raise InstallError(f"cannot read {path}: {error}") from None


def containerd_version() -> int:
    """The config version a new config.toml gets (3 for containerd 2.x)."""
    with contextlib.suppress(OSError):
        out = subprocess.run(["containerd", "--version"], capture_output=True, text=True,
                             timeout=10).stdout
        words = out.split()
        if len(words) >= 3 and words[2].lstrip("v").startswith("2."):
            return 3
    return 2


@dataclass
class Plan:
    """The engine configurations as they will be written, all checked."""

    docker: tuple[Doc, list[Edit]] | None = None
    containerd: tuple[Doc, list[Edit]] | None = None
    nvidia_programs: list[str] = field(default_factory=list)


def _without_previous(path: Path, doc: Doc, record: Record | None) -> Doc:
    """The document as it would be without an earlier install's edits."""
    if record is None or str(path) not in record.edits:
        return doc
    return undo(doc, record.edits[str(path)])


def plan_engines(layout: Layout, options: Options, record: Record | None) -> Plan:
    plan = Plan()
    wrapper = str(layout.wrapper)
    if "docker" in options.engines:
        path = layout.docker_config
        try:
            doc = _without_previous(path, dockerconf.parse(read_text(path)), record)
            plan.docker = dockerconf.register(doc, wrapper, default=options.docker_default,
                                              nvidia=options.nvidia_name)
        except ValueError as error:
            raise InstallError(f"{path}: {error}") from None
        program = dockerconf.nvidia_program(doc, wrapper)
        if options.nvidia_name and program:
            plan.nvidia_programs.append(program)
    if "containerd" in options.engines:
        path = layout.containerd_config
        try:
            doc = containerdconf.parse(read_text(path), containerd_version())
            doc = _without_previous(path, doc, record)
            plan.containerd = containerdconf.register(
                doc, wrapper, default=options.docker_default, nvidia=options.nvidia_name)
        except ValueError as error:
            raise InstallError(f"{path}: {error}") from None
        program = containerdconf.nvidia_program(doc, wrapper)
        if options.nvidia_name and program:
            plan.nvidia_programs.append(program)
    return plan


# --- steps --------------------------------------------------------------------

def running_from(prefix: Path) -> bool:
    return Path(sys.prefix).resolve() == (prefix / "venv").resolve()


def step_prefix(layout: Layout, options: Options, record: Record, say: Say) -> Path:
    """Build the prefix when installing from a checkout; the programs' folder."""
    if not options.build or running_from(layout.prefix):
        return layout.prefix / "venv" / "bin" if (layout.prefix / "venv").is_dir() \
            else Path(sys.executable).parent
    ours = record.notes.get("prefix_created", False)
    if layout.prefix.exists() and not ours:
        raise InstallError(f"{layout.prefix} exists and was not installed by cgpu-node "
                           "(remove it, or pass --no-build to use it as it is)")
    record.make_dirs(layout.prefix.parent)
    try:
        build_prefix(layout.prefix, options.python, options.wheel)
    except PrefixError as error:
        raise InstallError(str(error)) from None
    record.notes["prefix_created"] = True
    record.save()
    say(f"installed cgpu_km into {layout.prefix} (venv on {options.python})")
    return layout.prefix / "venv" / "bin"


def step_links(layout: Layout, programs: Path, record: Record, say: Say) -> None:
    linked = []
    for name in PROGRAMS:
        if (programs / name).exists():
            record.link(layout.bin_dir / name, programs / name)
            linked.append(name)
    say(f"linked {' '.join(linked)} into {layout.bin_dir}")


def hup_dockerd(pidfile: Path, say: Say) -> None:
    with contextlib.suppress(OSError, ValueError):
        pid = int(pidfile.read_text().strip())
        os.kill(pid, signal.SIGHUP)
        say(f"dockerd (pid {pid}) reloads its runtimes")


def write_doc(record: Record, path: Path, text: str, edits: list[Edit]) -> None:
    record.write(path, text.encode())
    record.edits[str(path)] = edits
    record.save()


def unit_programs(layout: Layout, options: Options) -> list[Path]:
    """What the units will execute: the links' folder, the programs and their interpreter."""
    if options.build and not running_from(layout.prefix):
        return [layout.bin_dir, layout.prefix, Path(options.python)]
    return [layout.bin_dir, Path(sys.executable).parent, Path(sys.executable)]


def check_units_can_run(layout: Layout, options: Options, say: Say) -> None:
    """The units have ProtectHome=yes: a program or interpreter under /root, /home or
    /run/user fails them with 203/EXEC. Refused when they are to be started, else said."""
    for path in unit_programs(layout, options):
        folder = hidden_from_units(path)
        if folder is None:
            continue
        why = (f"{path} is under {folder}, which the units' ProtectHome=yes hides from the "
               "services (they would fail with 203/EXEC)")
        if options.services and systemd_running():
            raise InstallError(f"{why}: install with --prefix, --bin-dir and --python "
                               "outside /root, /home and /run/user")
        say(f"warning: {why}")


def install(layout: Layout, options: Options, say: Say) -> None:
    """Install (or install again) on this node."""
    bad = [e for e in options.engines if e not in ENGINES]
    if bad:
        raise InstallError(f"unknown engine {bad[0]!r} (known: {', '.join(ENGINES)})")
    if options.build and not running_from(layout.prefix) and checkout() is None:
        raise InstallError("not running from a source checkout or an installed prefix: "
                           "pass --no-build")
    check_units_can_run(layout, options, say)
    previous = Record.load(layout.state_dir)
    plan = plan_engines(layout, options, previous)
    record = previous or Record(layout.state_dir)
    record.settings = {"layout": {k: str(v) for k, v in asdict(layout).items()},
                       "engines": list(options.engines), "docker_pidfile":
                       str(options.docker_pidfile), "enforce": options.enforce}
    record.save()
    try:
        programs = step_prefix(layout, options, record, say)
        step_links(layout, programs, record, say)
        parts = Parts.of(layout.prefix)
        settings = runtime_settings(parts, options, layout.hook, plan.nvidia_programs)
        record.write(layout.runtime_config, render_settings(settings).encode())
        say(f"wrote {layout.runtime_config}: the wrapper runs the first of "
            f"{', '.join(settings.runtimes)}")
        if plan.docker is not None:
            doc, edits = plan.docker
            write_doc(record, layout.docker_config, dockerconf.render(doc), edits)
            names = ["cgpu", *(["default"] if options.docker_default else []),
                     *(["nvidia"] if options.nvidia_name else [])]
            say(f"docker: {layout.docker_config}: runtime {' and '.join(names)}")
            hup_dockerd(options.docker_pidfile, say)
        if plan.containerd is not None:
            doc, edits = plan.containerd
            write_doc(record, layout.containerd_config, containerdconf.render(doc), edits)
            say(f"containerd: {layout.containerd_config}: CRI runtime cgpu (restart "
                "containerd to apply it)")
        if "podman" in options.engines:
            step_podman(layout, podman_hook_call(parts, options, layout.hook), record, say)
        step_units(layout, options, record, say)
    except InstallError:
        if previous is None:
            uninstall(layout.state_dir, lambda _: None)
        raise
    except (OSError, subprocess.SubprocessError) as error:
        if previous is None:
            uninstall(layout.state_dir, lambda _: None)
        raise InstallError(f"install failed: {error}") from None


def podman_start_stage() -> str:
    """The stage at which podman's runtimes run the hook (podmanhooks.start_for)."""
    found = [shutil.which(name) for name in podmanhooks.RUNTIMES]
    return podmanhooks.start_for([runtime_hooks(path) for path in found if path])


def step_podman(layout: Layout, hook: HookCall, record: Record, say: Say) -> None:
    """The hook files, and none left from an install that chose another stage."""
    start = podman_start_stage()
    documents = podmanhooks.hook_documents(hook, start)
    for name in podmanhooks.FILE_NAMES:
        path = layout.hooks_dir / name
        if name not in documents and record.holds_written(path):
            record.restore(path)
    for name, document in documents.items():
        record.write(layout.hooks_dir / name, podmanhooks.render(document).encode())
    say(f"podman: cgpu-hook at {start} and poststop in {layout.hooks_dir}")


def systemd_running() -> bool:
    return Path("/run/systemd/system").is_dir() and shutil.which("systemctl") is not None


def systemctl(*args: str) -> None:
    subprocess.run(["systemctl", *args], check=False, capture_output=True, timeout=120)


def step_units(layout: Layout, options: Options, record: Record, say: Say) -> None:
    units_dir = layout.prefix / "systemd"
    if not units_dir.is_dir():
        units_dir = (checkout() or Path("/nonexistent")) / "systemd"
    units = sorted(units_dir.glob("*.service"))
    for unit in units:
        record.write(layout.unit_dir / unit.name, unit_text(unit.read_text(),
                                                            layout.bin_dir).encode())
    names = [unit.name for unit in units]
    if names and options.services and systemd_running():
        systemctl("daemon-reload")
        systemctl("enable", "--now", *names)
        record.notes["services"] = names
        record.save()
        say(f"systemd: enabled and started {' '.join(names)}")
    elif names:
        say(f"systemd units in {layout.unit_dir} (not started: "
            f"{'--no-services' if not options.services else 'systemd is not running'})")


# --- uninstall ----------------------------------------------------------------

def _undo_shared(record: Record, path: Path) -> bool:
    """Take cgpu's edits out of an engine configuration edited since; True if done."""
    edits = record.edits.get(str(path))
    if edits is None or not path.is_file():
        return False
    module: Any = dockerconf if path.name == "daemon.json" else containerdconf
    try:
        doc = undo(module.parse(path.read_text()), edits)
    except (ValueError, OSError):
        return False
    record.write(path, module.render(doc).encode())
    record.written.pop(str(path), None)
    return True


def uninstall(state_dir: Path, say: Say) -> None:
    """Undo the install recorded in `state_dir`."""
    record = Record.load(state_dir)
    if record is None:
        raise InstallError(f"nothing to uninstall: no record in {state_dir}")
    services = record.notes.get("services", [])
    if services and systemd_running():
        systemctl("disable", "--now", *services)
        say(f"systemd: stopped and disabled {' '.join(services)}")
    for key in reversed(list(record.originals)):
        path = Path(key)
        if record.holds_written(path) or str(path) not in record.edits:
            record.restore(path)
        elif _undo_shared(record, path):
            say(f"{path} changed since the install: took cgpu's entries out, kept the rest")
    if services and systemd_running():
        systemctl("daemon-reload")
    layout = record.settings.get("layout", {})
    prefix = Path(layout["prefix"]) if "prefix" in layout else None
    if prefix is not None and record.notes.get("prefix_created"):
        shutil.rmtree(prefix, ignore_errors=True)
        say(f"removed {prefix}")
    left = record.remove_created_dirs()
    if left:
        say(f"kept folders that are not empty: {' '.join(left)}")
    say("restored the engines' configuration")
    pidfile = record.settings.get("docker_pidfile")
    if pidfile and "docker" in record.settings.get("engines", []):
        hup_dockerd(Path(pidfile), say)
        config = Path(layout.get("etc", "/etc")) / "docker" / "daemon.json"
        with contextlib.suppress(ValueError):
            if "runtimes" not in dockerconf.parse(read_text(config)):
                say(f"{config} names no runtimes now, and dockerd keeps those it has until "
                    "it restarts: restart docker to drop cgpu")
    record.forget()
