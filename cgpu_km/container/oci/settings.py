"""The wrapper's configuration: `/etc/cgpu_km/runtime.toml` (or $CGPU_RUNTIME_CONFIG).

    # The real runtime: the first of these that exists (names are looked up on PATH).
    runtimes = ["nvidia-container-runtime", "runc"]

    [hook]                      # how the runtime runs cgpu-hook
    path = "/usr/local/bin/cgpu-hook"
    root = "/proc/cgpu_km"      # optional: the control tree (else the hook's default)
    timeout = 30
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]

    [simgpu]                    # the simulated GPU, for hosts without one
    mode = "auto"               # auto: when there is no /dev/nvidiactl; on; off
    folder = "/opt/cgpu_km/simgpu"
    state = "/dev/shm/simgpu-state"
    devices = ""                # SIMGPU_DEVICES for the hook (optional)

Every key is optional; a missing file means all defaults. `parse_settings`
and `render_settings` are pure; an unknown key or a wrong type is an error
that names the key.
"""

from __future__ import annotations

import json
import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgpu_km import paths
from cgpu_km.container.envplan import ENFORCE
from cgpu_km.container.oci.spec import HookCall, SimGpu, env_map

CONFIG_ENV = "CGPU_RUNTIME_CONFIG"
DEFAULT_CONFIG = Path("/etc/cgpu_km/runtime.toml")
DEFAULT_RUNTIMES = ("nvidia-container-runtime", "runc")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_STATE = "/dev/shm/simgpu-state"
MODES = ("auto", "on", "off")
KEYS: dict[str | None, dict[str, type]] = {
    None: {"runtimes": list, "hook": dict, "simgpu": dict},
    "hook": {"path": str, "root": str, "timeout": int, "env": list},
    "simgpu": {"mode": str, "folder": str, "state": str, "devices": str},
}


class SettingsError(ValueError):
    """A bad configuration; `str(error)` is one line naming the key."""


@dataclass(frozen=True)
class Settings:
    runtimes: tuple[str, ...]
    hook: HookCall
    simulate: str  # auto, on, off
    simgpu: SimGpu
    simgpu_devices: str  # "" when not given

    @property
    def enforce(self) -> bool:
        """Whether the hook enforces cGPU on this node (CGPU_ENFORCE=1 in its env)."""
        return env_map(self.hook.env).get(ENFORCE, "").strip() == "1"

    def hook_for(self, simulating: bool) -> HookCall:
        """The hook call, with what the hook needs on simgpu added to its env."""
        if not simulating:
            return self.hook
        env = dict(pair.split("=", 1) for pair in self.hook.env if "=" in pair)
        extra = {"CGPU_SIMULATE": "1", paths.SIMGPU_DIR_ENV: str(self.simgpu.folder),
                 "SIMGPU_STATE": str(self.simgpu.state)}
        if self.simgpu_devices:
            extra["SIMGPU_DEVICES"] = self.simgpu_devices
        added = tuple(f"{k}={v}" for k, v in extra.items() if k not in env)
        return HookCall(self.hook.path, self.hook.root, self.hook.env + added,
                        self.hook.timeout)


def default_hook_path() -> str:
    """cgpu-hook beside the interpreter that runs the wrapper (same venv)."""
    return str(Path(sys.executable).parent / "cgpu-hook")


def _check(table: Mapping[str, Any], section: str | None) -> None:
    allowed = KEYS[section]
    prefix = f"{section}." if section else ""
    for key, value in table.items():
        if key not in allowed:
            raise SettingsError(f"{prefix}{key}: unknown key (known: {', '.join(allowed)})")
        if not isinstance(value, allowed[key]) or isinstance(value, bool):
            raise SettingsError(f"{prefix}{key}: expected {allowed[key].__name__}, "
                                f"got {type(value).__name__}")


def _strings(name: str, value: Sequence[Any]) -> tuple[str, ...]:
    if not all(isinstance(item, str) and item for item in value):
        raise SettingsError(f"{name}: expected a list of non-empty strings")
    return tuple(value)


def parse_settings(data: Mapping[str, Any]) -> Settings:
    """Settings from a parsed configuration (defaults for what it leaves out)."""
    _check(data, None)
    hook = data.get("hook", {})
    sim = data.get("simgpu", {})
    _check(hook, "hook")
    _check(sim, "simgpu")
    runtimes = _strings("runtimes", data.get("runtimes", list(DEFAULT_RUNTIMES)))
    if not runtimes:
        raise SettingsError("runtimes: name at least one runtime")
    env = _strings("hook.env", hook.get("env", [f"PATH={DEFAULT_PATH}"]))
    if not all("=" in pair for pair in env):
        raise SettingsError("hook.env: expected KEY=VALUE strings")
    timeout = hook.get("timeout", 30)
    if timeout <= 0:
        raise SettingsError(f"hook.timeout: {timeout} is not above 0")
    mode = sim.get("mode", "auto")
    if mode not in MODES:
        raise SettingsError(f"simgpu.mode: {mode!r} is none of {', '.join(MODES)}")
    return Settings(
        runtimes=runtimes,
        hook=HookCall(path=hook.get("path") or default_hook_path(),
                      root=hook.get("root") or None, env=env, timeout=timeout),
        simulate=mode,
        simgpu=SimGpu(folder=Path(sim.get("folder") or paths.simgpu_dir()),
                      state=Path(sim.get("state") or DEFAULT_STATE)),
        simgpu_devices=sim.get("devices", ""),
    )


def settings_path(environ: Mapping[str, str] = os.environ) -> Path:
    return Path(environ.get(CONFIG_ENV) or DEFAULT_CONFIG)


def load_settings(path: Path) -> Settings:
    """The settings in `path`; all defaults when it does not exist."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return parse_settings({})
    except OSError as error:
        raise SettingsError(f"cannot read {path}: {error.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise SettingsError(f"{path}: {error}") from None
    try:
        return parse_settings(data)
    except SettingsError as error:
        raise SettingsError(f"{path}: {error}") from None


def _string(text: str) -> str:
    """A TOML basic string: JSON's escapes, but not its surrogate pairs, and DEL escaped."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml(value: str | int | Sequence[str]) -> str:
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _string(value)
    return "[" + ", ".join(_string(item) for item in value) + "]"


def render_settings(settings: Settings) -> str:
    """The configuration file for `settings`, with its comments."""
    hook, sim = settings.hook, settings.simgpu
    lines = [
        "# cgpu-container-runtime (cgpu_km): which runtime runs the containers and how",
        "# cgpu-hook is called. Read at every container start.",
        "",
        "# The real runtime: the first of these that exists (names are looked up on PATH).",
        f"runtimes = {_toml(settings.runtimes)}",
        "",
        "[hook]",
        f"path = {_toml(hook.path)}",
        *([f"root = {_toml(hook.root)}"] if hook.root else
          ["# root = \"/proc/cgpu_km\"   # the control tree (default: the hook's own choice)"]),
        f"timeout = {hook.timeout}",
        "# The hook's whole environment (a runtime gives hooks nothing else).",
        f"env = {_toml(hook.env)}",
        "",
        "[simgpu]",
        "# The simulated GPU: auto (when there is no /dev/nvidiactl), on or off.",
        f"mode = {_toml(settings.simulate)}",
        f"folder = {_toml(str(sim.folder))}",
        "# The SIMGPU_STATE file of the host (its daemon's too).",
        f"state = {_toml(str(sim.state))}",
        f"devices = {_toml(settings.simgpu_devices)}",
        "",
    ]
    return "\n".join(lines)
