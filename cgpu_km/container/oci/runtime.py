"""`cgpu-container-runtime`: an OCI runtime that adds cgpu-hook, then runs the real one.

    cgpu-container-runtime [runc's global options] COMMAND [options] ID

Engines call it as they call runc (docker's `runtimes` in daemon.json,
containerd's runc `BinaryName`, `ctr run --runc-binary`). On `create` (and
`run`) it adds cgpu-hook to the bundle's config.json, at createRuntime when
the real runtime's `features` lists that hook, else at prestart, and at
poststop (cgpu_km.container.oci.spec.start_stage); the hook decides from the
container's environment whether anything happens. On simgpu it also mounts simgpu's libraries, its
`nvidia-smi` and the host's simgpu state into the container, and gives
`exec` processes the same GPUs as the container (cgpu_km.container.oci.spec). Then it
execs the real runtime (the first of `runtimes` in its configuration,
cgpu_km.container.oci.settings) with the same arguments; every other command goes
through untouched.

Errors are one line, written to the runtime log given with `--log` (in its
`--log-format`, which is how docker and containerd show a runtime's error)
and to stderr; the exit status is then 1 and the real runtime is not run.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cgpu_km.container.envplan import PlanError, switch_mode
from cgpu_km.container.oci.argv import CREATING, Invocation, parse_argv
from cgpu_km.container.oci.settings import (
    DEFAULT_RUNTIMES,
    Settings,
    SettingsError,
    load_settings,
    settings_path,
)
from cgpu_km.container.oci.spec import (
    DRIVER_DEVICE,
    SIMGPU_LIBRARIES,
    env_map,
    features_hooks,
    gpu_device_nodes,
    start_stage,
    with_agreeing_visible,
    with_hooks,
    with_simgpu,
    with_simgpu_env,
)
from cgpu_km.fileio import FileError, read_json_object, replace_file

PROG = "cgpu-container-runtime"
FEATURES_TIMEOUT = 10  # seconds for `runtime features`


class WrapperError(Exception):
    """A failure the user must see; `str(error)` is the one-line message."""


def simulating(settings: Settings) -> bool:
    if settings.simulate == "auto":
        return not os.path.exists(DRIVER_DEVICE)
    return settings.simulate == "on"


def _same_file(a: str, b: str) -> bool:
    with contextlib.suppress(OSError):
        return os.path.samefile(a, b)
    return False


def find_runtime(names: Sequence[str], environ: Mapping[str, str], own: str) -> str:
    """The first of `names` that is an executable (looked up on PATH when it
    has no slash), skipping this wrapper itself."""
    for name in names:
        found = name if "/" in name else shutil.which(name, path=environ.get("PATH"))
        if (found and os.path.isfile(found) and os.access(found, os.X_OK)
                and not _same_file(found, own)):
            return found
    raise WrapperError(f"no OCI runtime found: tried {', '.join(names)} "
                       f"(PATH={environ.get('PATH', '')})")


def read_json(path: Path) -> dict[str, Any]:
    try:
        return read_json_object(path)
    except FileError as error:
        raise WrapperError(str(error)) from None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace `path` atomically, keeping its mode."""
    try:
        replace_file(path, json.dumps(data), path.stat().st_mode & 0o7777)
    except OSError as error:
        raise WrapperError(f"cannot write {path}: {error.strerror}") from None


def check_simgpu(settings: Settings, config_file: Path) -> None:
    """simgpu's files are there, and so is its state (a bind mount needs the
    file): a missing or empty one is built by simgpu itself, with the
    configured devices, as the host's first GPU program would build it."""
    folder = settings.simgpu.folder
    for name in (*SIMGPU_LIBRARIES, "nvidia-smi"):
        if not (folder / name).is_file():
            raise WrapperError(f"simgpu's {name} is not in {folder} (build it with "
                               f"`make -C simgpu`, or set simgpu.folder in {config_file})")
    state = settings.simgpu.state
    with contextlib.suppress(OSError):
        if state.stat().st_size > 0:
            return
    env = {"PATH": "/usr/bin:/bin", "SIMGPU_STATE": str(state)}
    if settings.simgpu_devices:
        env["SIMGPU_DEVICES"] = settings.simgpu_devices
    try:
        state.parent.mkdir(parents=True, exist_ok=True)
        result = subprocess.run([str(folder / "nvidia-smi"), "-L"], env=env,
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        raise WrapperError(f"cannot create the simgpu state {state}: {error}") from None
    if result.returncode != 0:
        detail = (result.stderr.strip() or result.stdout.strip() or "failed").splitlines()[-1]
        raise WrapperError(f"cannot create the simgpu state {state}: {detail}")


def managed(config: dict[str, Any], enforce: bool) -> bool:
    """Whether cgpu-hook will manage the container of `config` (a bad value is
    the hook's to refuse)."""
    process = config.get("process")
    env = process.get("env") if isinstance(process, dict) else None
    try:
        return switch_mode(env_map(env if isinstance(env, list) else []), enforce,
                           bool(gpu_device_nodes(config))) is not None
    except PlanError:
        return False


def runtime_hooks(runtime: str) -> frozenset[str] | None:
    """The hooks that `runtime features` lists; None when it cannot tell
    (a runtime without the command, or one that fails)."""
    try:
        result = subprocess.run([runtime, "features"], stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=FEATURES_TIMEOUT)
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        return None
    return features_hooks(result.stdout) if result.returncode == 0 else None


def prepare_bundle(bundle: Path, settings: Settings, config_file: Path, start: str) -> None:
    """Add the hook (at `start` and poststop, and simgpu) to
    `<bundle>/config.json`; for a managed container, make NVIDIA's list of
    GPUs agree with the limited ones."""
    path = bundle / "config.json"
    config = read_json(path)
    if isinstance(config.get("process"), dict) and managed(config, settings.enforce):
        config = {**config, "process": with_agreeing_visible(config["process"])}
    simulate = simulating(settings)
    if simulate:
        check_simgpu(settings, config_file)
        config = with_simgpu(config, settings.simgpu)
    hook = settings.hook_for(simulate)
    write_json(path, with_hooks(config, hook, start,
                                functools.partial(_same_file, hook.path)))


def prepare_exec(process_file: Path) -> None:
    """On simgpu: the exec process sees the container's GPUs only."""
    process = read_json(process_file)
    edited = with_simgpu_env(process)
    if edited != process:
        write_json(process_file, edited)


def log_line(message: str, log_format: str, now: datetime.datetime) -> str:
    """One error line in runc's log format (json, else logfmt text)."""
    stamp = now.isoformat(timespec="seconds")
    if log_format == "json":
        return json.dumps({"level": "error", "msg": message, "time": stamp}) + "\n"
    return f"time={json.dumps(stamp)} level=error msg={json.dumps(message)}\n"


def report(invocation: Invocation, message: str) -> None:
    """Tell the engine (runtime log) and whoever watches stderr."""
    text = f"{PROG}: {message}"
    print(text, file=sys.stderr)
    if invocation.log is not None:
        line = log_line(text, invocation.log_format, datetime.datetime.now(datetime.UTC))
        with contextlib.suppress(OSError), invocation.log.open("a") as log:
            log.write(line)


def own_path() -> str:
    """This program's path, so that it never picks itself as the real runtime."""
    argv0 = sys.argv[0]
    return argv0 if "/" in argv0 else (shutil.which(argv0) or argv0)


def prepare(invocation: Invocation, environ: Mapping[str, str]) -> str:
    """Do the wrapper's part for this command; return the real runtime's path."""
    config_file = settings_path(environ)
    try:
        settings: Settings | None = load_settings(config_file)
    except SettingsError as error:
        if invocation.command in CREATING:
            raise WrapperError(str(error)) from None
        settings = None  # stopping and deleting must work with a broken file
    runtimes = settings.runtimes if settings is not None else DEFAULT_RUNTIMES
    runtime = find_runtime(runtimes, environ, own_path())
    if settings is not None and invocation.command in CREATING and invocation.bundle:
        prepare_bundle(invocation.bundle, settings, config_file,
                       start_stage(runtime_hooks(runtime)))
    elif (settings is not None and invocation.command == "exec"
          and invocation.process is not None and simulating(settings)):
        prepare_exec(invocation.process)
    return runtime


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    invocation = parse_argv(args, Path.cwd())
    try:
        runtime = prepare(invocation, os.environ)
    except WrapperError as error:
        report(invocation, str(error))
        return 1
    except Exception as error:
        report(invocation, f"internal error: {type(error).__name__}: {error}")
        return 1
    try:
        os.execv(runtime, [runtime, *args])
    except OSError as error:
        report(invocation, f"cannot run {runtime}: {error.strerror}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
