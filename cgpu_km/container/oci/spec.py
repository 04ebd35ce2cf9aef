"""Edits of an OCI runtime config (`config.json`), as pure functions.

`with_hooks` gives the config cgpu-hook at one start stage and at poststop,
and takes every other cgpu-hook entry out of every stage, so editing twice
is editing once and a config cannot add a second call or one at another
stage; the hook decides from the container's environment whether anything
happens. The start stage is `createRuntime` where the runtime says it runs
it (`start_stage`, from the `hooks` of `runtime features`), else the
deprecated `prestart`, which every runtime runs: runc and crun run both at
the same point (in the runtime's namespaces, after the container is created,
before pivot_root; prestart first), so the hook sees the same state there.

On simgpu (a host without a GPU), `with_simgpu` makes the container see the
simulated GPU the way a container on a GPU host sees NVIDIA's driver:
simgpu's `libcuda.so.1` and `libnvidia-ml.so.1` in the container's library
folder and its `nvidia-smi` in /usr/bin, read-only; the host's simgpu state
file (the device model the host daemon also uses) at simgpu's default path,
so every process finds it, `docker exec` ones included; and, for a container
given a subset of the GPUs, `SIMGPU_VISIBLE_DEVICES` with that subset (the
device nodes a GPU host's runtime would mount), also for exec processes
(`with_simgpu_env` on their process.json).
"""

from __future__ import annotations

import copy
import json
import os
import sysconfig
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOOK_PROGRAM = "cgpu-hook"
DRIVER_DEVICE = "/dev/nvidiactl"  # a host without it has no NVIDIA driver
PRESTART = "prestart"
CREATE_RUNTIME = "createRuntime"
POSTSTOP = "poststop"
START_STAGES = (CREATE_RUNTIME, PRESTART)  # where the hook registers the container
MULTIARCH = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
LIBRARY_FOLDER = f"/usr/lib/{MULTIARCH}"
SIMGPU_LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")
SMI_AT = "/usr/bin/nvidia-smi"
STATE_AT = "/dev/shm/simgpu-state"  # simgpu's default SIMGPU_STATE
VISIBLE_ENV = "SIMGPU_VISIBLE_DEVICES"
# The variables that name a container's GPUs, in the order cgpu-hook reads them.
VISIBLE_SOURCES = ("ALIYUN_COM_GPU_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
NO_GPU_WORDS = ("none", "void")

NVIDIA_MAJOR = 195  # the character devices of NVIDIA's driver: GPU N is minor N
NVIDIA_GPU_MINORS = range(254)  # 254: nvidia-modeset, 255: nvidiactl

Config = dict[str, Any]


@dataclass(frozen=True)
class HookCall:
    """How the runtime runs cgpu-hook."""

    path: str
    root: str | None = None  # --root, else the hook's own default
    env: tuple[str, ...] = ()
    timeout: int = 30

    def entry(self, stage: str) -> dict[str, Any]:
        args = [HOOK_PROGRAM, *(("--root", self.root) if self.root else ()), stage]
        return {"path": self.path, "args": args, "env": list(self.env),
                "timeout": self.timeout}


def features_hooks(text: str) -> frozenset[str] | None:
    """The hooks that a runtime's `features` output (runc 1.1+, crun 1.8+)
    says it runs, or None when the output does not say."""
    try:
        features = json.loads(text)
    except ValueError:
        return None
    hooks = features.get("hooks") if isinstance(features, dict) else None
    if not isinstance(hooks, list) or not all(isinstance(h, str) for h in hooks):
        return None
    return frozenset(hooks)


def start_stage(runtime_hooks: Collection[str] | None) -> str:
    """The stage at which cgpu-hook registers the container: createRuntime
    when the runtime lists it, else prestart (also when it cannot tell)."""
    if runtime_hooks is not None and CREATE_RUNTIME in runtime_hooks:
        return CREATE_RUNTIME
    return PRESTART


def is_cgpu_hook(entry: object, path: str | None = None,
                 same_program: Callable[[str], bool] | None = None) -> bool:
    """Whether a hook entry runs cgpu-hook: by its program's name (path or
    argv[0]), its path being `path`, or `same_program` saying so."""
    if not isinstance(entry, dict):
        return False
    program = entry.get("path")
    args = entry.get("args")
    names = [program, args[0] if isinstance(args, list) and args else None]
    if any(isinstance(n, str) and os.path.basename(n) == HOOK_PROGRAM for n in names):
        return True
    if not isinstance(program, str):
        return False
    return program == path or (same_program is not None and same_program(program))


def with_hooks(config: Config, hook: HookCall, start: str,
               same_program: Callable[[str], bool] | None = None) -> Config:
    """`config` with cgpu-hook last among its `start` hooks and its poststop
    hooks, and nowhere else (`is_cgpu_hook` decides what is cgpu-hook)."""
    if start not in START_STAGES:
        raise ValueError(f"{start!r} is not a start stage ({', '.join(START_STAGES)})")
    result = copy.deepcopy(config)
    hooks = result.get("hooks")
    if not isinstance(hooks, dict):
        hooks = {}
    for stage, entries in hooks.items():
        if isinstance(entries, list):
            hooks[stage] = [e for e in entries if not is_cgpu_hook(e, hook.path, same_program)]
    for stage in (start, POSTSTOP):
        current = hooks.get(stage)
        hooks[stage] = [*(current if isinstance(current, list) else []), hook.entry(stage)]
    result["hooks"] = hooks
    return result


@dataclass(frozen=True)
class SimGpu:
    """simgpu's files on the host."""

    folder: Path  # libcuda.so.1, libnvidia-ml.so.1, nvidia-smi
    state: Path  # the SIMGPU_STATE file the host uses


def _bind(source: Path, destination: str, readonly: bool) -> dict[str, Any]:
    options = ["rbind", "nosuid", "nodev", "ro" if readonly else "rw"]
    return {"destination": destination, "type": "bind", "source": str(source),
            "options": options}


def simgpu_mounts(sim: SimGpu) -> list[dict[str, Any]]:
    """The bind mounts that put simgpu into a container (all read-only but
    the state file, which its processes write as they use the GPU)."""
    mounts = [_bind(sim.folder / name, f"{LIBRARY_FOLDER}/{name}", True)
              for name in SIMGPU_LIBRARIES]
    mounts.append(_bind(sim.folder / "nvidia-smi", SMI_AT, True))
    mounts.append(_bind(sim.state, STATE_AT, False))
    return mounts


def visible_devices(env: Mapping[str, str]) -> str | None:
    """SIMGPU_VISIBLE_DEVICES for a process environment: the GPUs its
    container was given, or None when it was given all of them."""
    for name in VISIBLE_SOURCES:
        text = env.get(name, "").strip()
        if text:
            if text.lower() == "all":
                return None
            return "none" if text.lower() in NO_GPU_WORDS else text.replace(" ", "")
    return None


def env_map(pairs: Sequence[object]) -> dict[str, str]:
    """`KEY=VALUE` strings as a mapping (the last one wins, as in execve)."""
    result: dict[str, str] = {}
    for pair in pairs:
        if isinstance(pair, str) and "=" in pair:
            key, value = pair.split("=", 1)
            result[key] = value
    return result


def with_simgpu_env(process: Config) -> Config:
    """An OCI `process` object with SIMGPU_VISIBLE_DEVICES set from its own
    environment (replacing one already there); unchanged when it sees all GPUs."""
    env = process.get("env")
    pairs = [p for p in env if isinstance(p, str)] if isinstance(env, list) else []
    wanted = visible_devices(env_map(pairs))
    if wanted is None:
        return copy.deepcopy(process)
    result = copy.deepcopy(process)
    result["env"] = [p for p in pairs if not p.startswith(f"{VISIBLE_ENV}=")]
    result["env"].append(f"{VISIBLE_ENV}={wanted}")
    return result


def with_simgpu(config: Config, sim: SimGpu) -> Config:
    """`config` with simgpu mounted in (mounts to the same places replaced)."""
    result = copy.deepcopy(config)
    added = simgpu_mounts(sim)
    targets = {m["destination"] for m in added}
    mounts = result.get("mounts")
    kept = [m for m in mounts if not (isinstance(m, dict) and m.get("destination") in targets)
            ] if isinstance(mounts, list) else []
    result["mounts"] = [*kept, *added]
    process = result.get("process")
    if isinstance(process, dict):
        result["process"] = with_simgpu_env(process)
    return result


def gpu_device_nodes(config: Config) -> list[int]:
    """The GPUs (minor numbers) whose device nodes the config gives the
    container (`--device`, CDI), whatever path they have inside."""
    linux = config.get("linux")
    devices = linux.get("devices") if isinstance(linux, dict) else None
    found: list[int] = []
    for device in devices if isinstance(devices, list) else []:
        if not isinstance(device, dict) or device.get("type") != "c":
            continue
        major, minor = device.get("major"), device.get("minor")
        if (major == NVIDIA_MAJOR and isinstance(minor, int) and not isinstance(minor, bool)
                and minor in NVIDIA_GPU_MINORS):
            found.append(minor)
    return found


def with_agreeing_visible(process: Config) -> Config:
    """An OCI `process` whose NVIDIA_VISIBLE_DEVICES names the GPUs that its
    ALIYUN_COM_GPU_VISIBLE_DEVICES limits, when NVIDIA's is unset or `all`, so
    that NVIDIA's runtime exposes just the limited GPUs. Any other NVIDIA list
    is left for cgpu-hook to compare (and refuse when it names other GPUs)."""
    env = process.get("env")
    pairs = [p for p in env if isinstance(p, str)] if isinstance(env, list) else []
    values = env_map(pairs)
    aliyun, nvidia = (values.get(name, "").strip() for name in VISIBLE_SOURCES)
    if not aliyun or nvidia.lower() not in ("", "all"):
        return copy.deepcopy(process)
    result = copy.deepcopy(process)
    result["env"] = [*pairs, f"{VISIBLE_SOURCES[1]}={aliyun}"]
    return result
