"""`cgpu-hook`: the OCI hook that registers containers in the control tree.

    cgpu-hook [--root DIR] plan [--env KEY=VALUE ...]   print the plan as JSON
    cgpu-hook [--root DIR] createRuntime                OCI state on stdin
    cgpu-hook [--root DIR] prestart                     the same, for older runtimes
    cgpu-hook [--root DIR] poststop                     OCI state on stdin

`createRuntime` and `prestart` are one command under the names of the two
OCI hooks that runtimes run at the same point: in the runtime's namespaces,
once the container's namespaces exist and before its init's pivot_root
(cgpu_km.container.oci.spec.start_stage picks one). It resolves the
container's environment (its bundle's config.json) into a plan
(cgpu_km.container.envplan) and runs PRESTART_STEPS in order; each step
records how to undo what it did, and when a step fails everything done so
far is undone, so a failed start leaves nothing behind. A second start of
the same container (started again without its poststop) replaces what the
first registered (cgpu_km.container.claims); a second call in the same
start (the hook configured at both stages) does nothing, and a call once
the init has left the runtime's root (a later stage) is refused.
`poststop` runs POSTSTOP_STEPS, each idempotent, unless another container
holds the id. Errors are one line on stderr; a bad environment value exits
2, any other failure 1.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from cgpu_km.container import claims
from cgpu_km.container.envplan import (
    DEFAULT_MAX_INST,
    DISABLED,
    ENFORCE,
    Plan,
    PlanError,
    parse_request,
    place,
    switch_mode,
)
from cgpu_km.container.inject import create_region, inject_data_plane, remove_data_plane
from cgpu_km.container.oci.spec import START_STAGES, env_map, gpu_device_nodes
from cgpu_km.container.steps import (
    EXIT_BAD_VALUE,
    EXIT_FAILED,
    PROG,
    HookContext,
    HookError,
    PoststopStep,
    PrestartStep,
    Undo,
)
from cgpu_km.dataplane import kernelview
from cgpu_km.dataplane import region as region_mod
from cgpu_km.fileio import FileError, read_json_object
from cgpu_km.gpus import GpuError, discover_gpus
from cgpu_km.tree import client as treefs

_ERRNO_MEANING = {
    errno.EEXIST: "a container with this id is already registered there",
    errno.ENODEV: "the control tree has no such GPU",
    errno.ENOSPC: "max_inst containers are already on that GPU",
    errno.EINVAL: "the control tree refused the command",
    errno.EACCES: "permission denied (the hook must run as root)",
    errno.EPERM: "permission denied (the hook must run as root)",
}


def describe_oserror(error: OSError) -> str:
    code = errno.errorcode.get(error.errno or 0, str(error.errno))
    meaning = _ERRNO_MEANING.get(error.errno or 0, error.strerror or "failed")
    return f"{code}: {meaning}"


def _inst_ctl(ctx: HookContext, command: str) -> None:
    treefs.inst_ctl(ctx.root, command)


def register_on_gpus(ctx: HookContext, undo: Undo) -> None:
    """`inst_ctl add` the container on each of its GPUs."""
    for gpu in ctx.plan.gpus:
        command = (f"add {gpu.index} {ctx.id12} memsize={gpu.memsize} weight={gpu.weight} "
                   f"highprio={gpu.highprio} util_limit={gpu.util_limit}")
        try:
            _inst_ctl(ctx, command)
        except OSError as error:
            raise HookError(f"registering container {ctx.id12} on GPU {gpu.index} failed: "
                            f"{describe_oserror(error)}") from None
        undo.push(f"GPU {gpu.index} registration",
                  functools.partial(_inst_ctl, ctx, f"del {gpu.index} {ctx.id12}"))


def unregister_from_gpus(ctx: HookContext) -> None:
    """`inst_ctl del <id12>` on every GPU; a container already gone is fine."""
    try:
        _inst_ctl(ctx, f"del {ctx.id12}")
    except OSError as error:
        if error.errno != errno.ENOENT:
            raise HookError(f"removing container {ctx.id12} failed: "
                            f"{describe_oserror(error)}") from None


def is_registered(ctx: HookContext) -> bool:
    """Whether the tree lists the container's id on any GPU."""
    try:
        return any(entry.name.isdigit() and (entry / ctx.id12).is_dir()
                   for entry in ctx.root.iterdir())
    except OSError:
        return False


def claim_id(ctx: HookContext, undo: Undo) -> None:
    """Record this container as the holder of its tree id (cgpu_km.container.claims).
    When it held the id already (started again without its poststop having
    run), its old registration and region are removed first."""
    recorded = claims.read(ctx.id12)
    action = claims.decide(recorded, ctx.container_id, is_registered(ctx))
    if action is claims.Claim.REFUSE:
        raise HookError(f"container id {ctx.id12} is in use by another container "
                        f"({recorded}): the tree knows containers by 12 characters")
    if action is claims.Claim.TAKE_OVER:
        for step in (unregister_from_gpus, remove_data_plane):
            step(ctx)
    try:
        claims.write(ctx.id12, ctx.container_id)
    except OSError as error:
        raise HookError(f"recording the holder of {ctx.id12} in {claims.claim_dir()} "
                        f"failed: {error.strerror}") from None
    undo.push("id claim", functools.partial(claims.drop, ctx.id12))


def release_id(ctx: HookContext) -> None:
    """poststop step: forget the holder (idempotent)."""
    try:
        claims.drop(ctx.id12)
    except OSError as error:
        raise HookError(f"removing {claims.claim_dir() / ctx.id12} failed: "
                        f"{error.strerror}") from None


def started_already(ctx: HookContext) -> bool:
    """Whether this very start of the container ran the hook already (a
    config with the hook at both createRuntime and prestart): the container
    holds its id, is registered, and its region records this init process."""
    if ctx.pid is None or claims.read(ctx.id12) != ctx.container_id or not is_registered(ctx):
        return False
    recorded = kernelview.read_owner(region_mod.region_path(ctx.id12))
    current = kernelview.owner_of(ctx.pid, cgroups=False)
    return (recorded is not None and current is not None and recorded.pid == ctx.pid
            and recorded.start_time == current.start_time)


# The region comes before the registration, so that the daemon finds it as
# soon as the tree lists the container.
PRESTART_STEPS: list[PrestartStep] = [claim_id, create_region, register_on_gpus,
                                      inject_data_plane]
POSTSTOP_STEPS: list[PoststopStep] = [unregister_from_gpus, remove_data_plane, release_id]


def run_prestart_steps(ctx: HookContext, steps: Sequence[PrestartStep], stderr: TextIO) -> None:
    """Run every step, or undo the completed ones and re-raise."""
    undo = Undo()
    try:
        for step in steps:
            step(ctx, undo)
    except BaseException:
        undo.run(stderr)
        raise


# --- inputs -----------------------------------------------------------------

@dataclass(frozen=True)
class OciState:
    """The fields of the OCI state that the hook uses."""

    container_id: str
    bundle: Path
    pid: int | None


def read_state(stream: TextIO) -> OciState:
    """The OCI state the runtime writes on the hook's stdin."""
    try:
        state = json.load(stream)
    except (ValueError, UnicodeDecodeError) as error:
        raise HookError(f"OCI state on stdin is not JSON: {error}") from None
    if not isinstance(state, dict):
        raise HookError("OCI state on stdin is not a JSON object")
    container_id = state.get("id")
    bundle = state.get("bundle") or state.get("bundlePath")  # old runtimes: bundlePath
    if not isinstance(container_id, str) or not container_id:
        raise HookError("OCI state on stdin has no container id")
    if not isinstance(bundle, str) or not bundle:
        raise HookError("OCI state on stdin has no bundle")
    pid = state.get("pid")
    return OciState(container_id, Path(bundle),
                    pid if isinstance(pid, int) and not isinstance(pid, bool) else None)


def pivoted(pid: int) -> bool:
    """Whether the container's init has left the runtime's root: then it is
    past createRuntime and prestart (a config with the hook at poststart),
    and its processes may run already. The state's status cannot tell:
    runc says `created` at poststart, as crun does at prestart."""
    try:
        theirs, ours = os.stat(f"/proc/{pid}/root"), os.stat("/")
    except OSError:
        return False  # gone or unreadable: the steps say what is wrong
    return (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino)


def container_config(bundle: Path) -> dict[str, object]:
    """`<bundle>/config.json`."""
    try:
        return read_json_object(bundle / "config.json")
    except FileError as error:
        raise HookError(str(error)) from None


def config_env(config: Mapping[str, object]) -> dict[str, str]:
    """The container process's environment in its config."""
    process = config.get("process")
    pairs = process.get("env") if isinstance(process, dict) else None
    return env_map(pairs if isinstance(pairs, list) else [])


def container_env(bundle: Path) -> dict[str, str]:
    """The container process's environment from `<bundle>/config.json`."""
    return config_env(container_config(bundle))


def require_tree(root: Path) -> None:
    if not treefs.serves(root):
        raise HookError(f"no control tree at {root} (start cgpu-fuse or load cgpu_km.ko, "
                        "or pass --root / set CGPU_KM_ROOT)")


def tree_max_inst(root: Path) -> dict[int, int]:
    """max_inst of each GPU in the tree (GPUs it cannot read are left out)."""
    limits: dict[int, int] = {}
    try:
        entries = list(root.iterdir())
    except OSError:
        return limits
    for entry in entries:
        if entry.name.isdigit():
            try:
                limits[int(entry.name)] = treefs.read_int(entry / "max_inst")
            except (OSError, ValueError):
                continue
    return limits


def enforcing() -> bool:
    """Whether this node enforces cGPU: the hook's own environment says so
    (`cgpu-node install --enforce`), which no container can change."""
    return os.environ.get(ENFORCE, "").strip() == "1"


def tree_default_memsize(root: Path | None) -> int:
    try:
        return 0 if root is None else treefs.read_int(root / "default_memsize")
    except (OSError, ValueError):
        return 0


def make_plan(env: Mapping[str, str], root: Path | None,
              device_nodes: Sequence[int] = ()) -> Plan:
    """The plan for `env` (and the GPU device nodes the container is given);
    NVML is consulted only when a switch is on."""
    try:  # bad values are reported before NVML is asked
        request = parse_request(env, enforcing(), bool(device_nodes))
        if request is None:
            return DISABLED
        gpus = discover_gpus()
        limits: dict[int, int] | int = DEFAULT_MAX_INST if root is None else tree_max_inst(root)
        return place(request, gpus, limits, device_nodes, tree_default_memsize(root))
    except PlanError as error:
        raise HookError(str(error), EXIT_BAD_VALUE) from None
    except GpuError as error:
        raise HookError(str(error)) from None


# --- commands ---------------------------------------------------------------

def cmd_plan(args: argparse.Namespace) -> int:
    env: Mapping[str, str]
    if args.env is None:
        env = os.environ
    else:
        bad = [pair for pair in args.env if "=" not in pair]
        if bad:
            raise HookError(f"--env {bad[0]!r}: expected KEY=VALUE", EXIT_BAD_VALUE)
        env = env_map(args.env)
    root = treefs.resolve_root(args.root)
    print(make_plan(env, root if treefs.serves(root) else None).to_json())
    return 0


def cmd_prestart(args: argparse.Namespace) -> int:
    state = read_state(sys.stdin)
    config = container_config(state.bundle)
    env = config_env(config)
    device_nodes = gpu_device_nodes(config)
    try:
        enabled = switch_mode(env, enforcing(), bool(device_nodes)) is not None
    except PlanError as error:
        raise HookError(str(error), EXIT_BAD_VALUE) from None
    if not enabled:
        return 0
    if state.pid is not None and pivoted(state.pid):
        raise HookError(f"container {state.container_id[:12]} has left the runtime's root "
                        f"(pivot_root): cgpu-hook {args.command} must run at createRuntime or "
                        "prestart, before its processes start")
    root = treefs.resolve_root(args.root)
    require_tree(root)
    ctx = HookContext(root=root, container_id=state.container_id, bundle=state.bundle,
                      env=env, plan=make_plan(env, root, device_nodes),
                      pid=state.pid)
    if not ctx.plan.enabled:
        return 0
    if started_already(ctx):
        print(f"{PROG}: warning: {ctx.id12} is registered by this start already (the hook "
              "is configured at two stages): nothing to do", file=sys.stderr)
        return 0
    run_prestart_steps(ctx, PRESTART_STEPS, sys.stderr)
    return 0


def cmd_poststop(args: argparse.Namespace) -> int:
    state = read_state(sys.stdin)
    try:
        config = container_config(state.bundle)
        env = config_env(config)
        if switch_mode(env, enforcing(), bool(gpu_device_nodes(config))) is None:
            return 0
    except (HookError, PlanError):
        env = {}  # cannot tell: clean up anyway, which is harmless
    root = treefs.resolve_root(args.root)
    ctx = HookContext(root=root, container_id=state.container_id, bundle=state.bundle,
                      env=env, pid=state.pid)
    recorded = claims.read(ctx.id12)
    if not claims.owns(recorded, ctx.container_id):
        return 0  # another container holds the id: nothing here is ours
    steps = POSTSTOP_STEPS
    if not treefs.serves(root):
        # No tree (cgpu-fuse down or restarting): nothing is registered, but the
        # container's region and claim, if it has them, are still on the host.
        if recorded is None:
            return 0
        steps = [step for step in POSTSTOP_STEPS if step is not unregister_from_gpus]
    failures: list[str] = []
    for step in steps:
        try:
            step(ctx)
        except HookError as error:
            failures.append(str(error))
    if failures:
        raise HookError("; ".join(failures))
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", default=argparse.SUPPRESS,
                        help="control tree (default: $CGPU_KM_ROOT, /proc/cgpu_km, "
                             "/run/cgpu_km)")
    parser = argparse.ArgumentParser(prog=PROG, parents=[common],
                                     description="OCI hook for GPU sharing (cgpu_km)")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", parents=[common],
                               help="print the plan for this environment as JSON")
    plan.add_argument("--env", action="append", metavar="KEY=VALUE",
                      help="resolve these pairs instead of this process's environment")
    plan.set_defaults(handler=cmd_plan)
    for stage in START_STAGES:
        commands.add_parser(stage, parents=[common],
                            help="register the container (OCI state on stdin)"
                            ).set_defaults(handler=cmd_prestart)
    commands.add_parser("poststop", parents=[common],
                        help="remove the container (OCI state on stdin)"
                        ).set_defaults(handler=cmd_poststop)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not hasattr(args, "root"):
        args.root = None
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except HookError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return error.exit_code
    except Exception as error:
        print(f"{PROG}: internal error: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
