"""`cgpu-node`: install cgpu_km on this node, or take it away again.

    cgpu-node install [--docker-default] [--nvidia-name] [--engines docker,containerd,podman]
                      [--enforce] [--tree-root DIR] [--simulate auto|on|off] [--no-services]
                      [--no-build] [--wheel CGPU_KM.whl]
    cgpu-node uninstall
    cgpu-node status

Run as root from a source checkout after `make setup` (no network needed).
See cgpu_km.node.install for the steps. Errors are one line on stderr,
exit status 1, and nothing is changed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from cgpu_km.container.oci.settings import DEFAULT_STATE, MODES
from cgpu_km.node.install import ENGINES, InstallError, Layout, Options, install, uninstall
from cgpu_km.node.prefix import default_python
from cgpu_km.node.record import Record

PROG = "cgpu-node"
ENGINE_PROGRAMS = {"docker": "dockerd", "containerd": "containerd", "podman": "podman"}


def installed_engines() -> tuple[str, ...]:
    return tuple(e for e in ENGINES if shutil.which(ENGINE_PROGRAMS[e]))


def engine_list(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [n for n in names if n not in ENGINES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown engine {bad[0]!r} (known: "
                                         f"{', '.join(ENGINES)})")
    return names


def build_parser() -> argparse.ArgumentParser:
    layout = argparse.ArgumentParser(add_help=False)
    defaults = Layout()
    layout.add_argument("--state-dir", type=Path, default=defaults.state_dir,
                        help=f"the install record and backups (default {defaults.state_dir})")
    parser = argparse.ArgumentParser(prog=PROG, description="Install cgpu_km on this node.")
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("install", parents=[layout], help="install or install again")
    add.add_argument("--prefix", type=Path, default=defaults.prefix)
    add.add_argument("--bin-dir", type=Path, default=defaults.bin_dir)
    add.add_argument("--etc", type=Path, default=defaults.etc,
                     help="where the engines' configurations are (default /etc)")
    add.add_argument("--engines", type=engine_list, default=None,
                     help="comma list of docker, containerd, podman (default: those installed)")
    add.add_argument("--docker-default", action="store_true",
                     help="make cgpu the default runtime (docker, and containerd's CRI)")
    add.add_argument("--nvidia-name", action="store_true",
                     help="the runtime name nvidia runs the wrapper, with NVIDIA's runtime "
                          "behind it (`docker run --runtime=nvidia` as in the cGPU documents)")
    add.add_argument("--tree-root", help="the control tree the hook uses (default: its own "
                     "choice: $CGPU_KM_ROOT, /proc/cgpu_km, /run/cgpu_km)")
    add.add_argument("--simulate", choices=MODES, default="auto",
                     help="simgpu in containers: auto (no /dev/nvidiactl), on, off")
    add.add_argument("--simgpu-state", default=DEFAULT_STATE)
    add.add_argument("--simgpu-devices", default="", help="SIMGPU_DEVICES for the hook")
    add.add_argument("--enforce", action="store_true",
                     help="manage every container given a GPU (default_memsize, weight 1 "
                          "without cGPU variables) and refuse CGPU_DISABLE and 0 elements")
    add.add_argument("--hook-env", action="append", default=[], metavar="KEY=VALUE",
                     help="more environment for the hook (repeatable)")
    add.add_argument("--docker-pidfile", type=Path, default=Path("/var/run/docker.pid"))
    add.add_argument("--python", default=None,
                     help="the interpreter of the prefix's venv (default /usr/bin/python3)")
    add.add_argument("--no-services", action="store_true",
                     help="install the systemd units but do not enable them")
    add.add_argument("--no-build", action="store_true",
                     help="do not build the prefix (use it, or this environment, as it is)")
    add.add_argument("--wheel", type=Path, default=None,
                     help="install cgpu_km from this wheel (`pip wheel --no-deps .`) instead "
                          "of building one here")
    commands.add_parser("uninstall", parents=[layout], help="undo the install")
    commands.add_parser("status", parents=[layout], help="print the install record")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def say(line: str) -> None:
        print(f"{PROG}: {line}", flush=True)

    try:
        if args.command == "install":
            if args.wheel is not None and args.no_build:
                raise InstallError("--wheel builds the prefix: it cannot go with --no-build")
            bad = [pair for pair in args.hook_env if "=" not in pair]
            if bad:
                raise InstallError(f"--hook-env {bad[0]!r}: expected KEY=VALUE")
            layout = Layout(prefix=args.prefix, bin_dir=args.bin_dir, etc=args.etc,
                            state_dir=args.state_dir)
            options = Options(
                engines=args.engines if args.engines is not None else installed_engines(),
                docker_default=args.docker_default, nvidia_name=args.nvidia_name,
                tree_root=args.tree_root, simulate=args.simulate,
                simgpu_state=args.simgpu_state, simgpu_devices=args.simgpu_devices,
                hook_env=tuple(args.hook_env), enforce=args.enforce, services=not args.no_services,
                build=not args.no_build, python=args.python or default_python(),
                docker_pidfile=args.docker_pidfile, wheel=args.wheel)
            install(layout, options, say)
        elif args.command == "uninstall":
            uninstall(args.state_dir, say)
        else:
            record = Record.load(args.state_dir)
            if record is None:
                print(f"{PROG}: not installed (no record in {args.state_dir})")
                return 1
            print(json.dumps({"enforce": bool(record.settings.get("enforce", False)),
                              "settings": record.settings, "files": sorted(record.written),
                              "notes": record.notes}, indent=1))
        return 0
    except InstallError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
