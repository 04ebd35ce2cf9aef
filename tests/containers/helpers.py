"""Shared by the engine tests: a simulated GPU host and what its tree holds."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from cgpu_km import paths
from cgpu_km.container.oci.settings import DEFAULT_PATH, Settings, render_settings
from cgpu_km.container.oci.spec import CREATE_RUNTIME, HookCall, SimGpu
from cgpu_km.demo.dockerd import PrivateDocker
from cgpu_km.tree import client as treefs

VENV_BIN = Path(sys.executable).parent
WRAPPER = VENV_BIN / "cgpu-container-runtime"
HOOK = VENV_BIN / "cgpu-hook"
IMAGE = "cgpu-test:latest"
MIB = 1 << 20
UUIDS = ("GPU-c0ffee00-0000-4000-8000-000000000000", "GPU-c0ffee01-0000-4000-8000-000000000001")
DEVICES = ",".join(f"Tesla T4:15109MiB:{uuid}" for uuid in UUIDS)
T4 = 15109 * MIB
LIMIT_6_OF_15 = T4 * 6 // 15  # shown as 6043 MiB
CUDA_OOM = "CUDA_ERROR_OUT_OF_MEMORY"
CGPU_6_OF_15 = ["-e", "ALIYUN_COM_GPU_MEM_CONTAINER=6", "-e", "ALIYUN_COM_GPU_MEM_DEV=15"]
HOLD = ["sh", "-c", "cuworkload --alloc 1GiB --hold 600"]


def missing(*programs: str) -> str | None:
    """The first program not on PATH, if any."""
    return next((p for p in programs if shutil.which(p) is None), None)


def built() -> bool:
    simgpu = paths.simgpu_dir()
    return all((simgpu / name).is_file() for name in
               ("libcuda.so.1", "libnvidia-ml.so.1", "nvidia-smi", "cuworkload")
               ) and paths.libcgpu().is_file()


@dataclass
class SimHost:
    """A host without a GPU: simgpu with two T4s, a FUSE tree, the hook's folders."""

    tree: Path
    folder: Path

    @property
    def state(self) -> Path:
        return self.folder / "simgpu-state"

    @property
    def regions(self) -> Path:
        return self.folder / "regions"

    @property
    def claims(self) -> Path:
        return self.folder / "claims"

    def hook_env(self) -> tuple[str, ...]:
        return (f"PATH={DEFAULT_PATH}", f"CGPU_REGION_DIR={self.regions}",
                f"CGPU_HOOK_STATE_DIR={self.claims}", "SIMGPU_CONTEXT_MEM=0")

    def settings(self, runtimes: tuple[str, ...] = ("runc",)) -> Settings:
        return Settings(runtimes=runtimes,
                        hook=HookCall(path=str(HOOK), root=str(self.tree), env=self.hook_env()),
                        simulate="on", simgpu=SimGpu(paths.simgpu_dir(), self.state),
                        simgpu_devices=DEVICES)

    def write_config(self, path: Path, runtimes: tuple[str, ...] = ("runc",)) -> None:
        path.write_text(render_settings(self.settings(runtimes)))

    def registered(self) -> dict[int, dict[str, int]]:
        """GPU -> container -> memsize, as the tree says."""
        return {gpu.index: {name: c.memsize for name, c in gpu.containers.items()}
                for gpu in treefs.read_tree(self.tree).gpus}

    def leftovers(self) -> list[str]:
        """Regions and claim records still on the host."""
        return [str(p) for folder in (self.regions, self.claims) if folder.is_dir()
                for p in folder.iterdir()]


NOTHING: dict[int, dict[str, int]] = {0: {}, 1: {}}  # as registered() says: no containers


def run_detached(docker: PrivateDocker, name: str, *args: str,
                 command: list[str] = HOLD) -> str:
    """`docker run -d -t --runtime=cgpu` as in the cGPU document; its id as `docker ps` shows."""
    docker.check("run", "-d", "-t", "--runtime=cgpu", "--network=none", "--name", name, *args,
                 IMAGE, *command)
    return docker.check("ps", "--filter", f"name=^{name}$", "--format", "{{.ID}}").strip()


# runc in front of runc: at each create it appends to LOG the stage -> commands
# at which the bundle calls cgpu-hook; `features` is runc's own unless told to
# fail as in runc 1.0, which has no such command.
RECORDING_RUNC = """#!{python}
import json, os, shutil, sys
from pathlib import Path
from cgpu_km.container.oci.argv import CREATING, parse_argv

args = sys.argv[1:]
if args[:1] == ["features"] and {old}:
    sys.exit("runc: No help topic for 'features'")
call = parse_argv(args, Path.cwd())
if call.command in CREATING and call.bundle is not None:
    hooks = json.loads((call.bundle / "config.json").read_text()).get("hooks", {{}})
    calls = {{stage: [e["args"][-1] for e in entries
                     if os.path.basename(e["path"]) == "cgpu-hook"]
             for stage, entries in hooks.items()}}
    with open({log!r}, "a") as log:
        log.write(json.dumps({{k: v for k, v in calls.items() if v}}) + "\\n")
runc = shutil.which("runc")
os.execv(runc, [runc, *args])
"""


@dataclass(frozen=True)
class RecordingRunc:
    """The wrapper's real runtime in the engine tests (RECORDING_RUNC)."""

    path: Path
    log: Path
    start: str  # the stage the wrapper should pick for it

    @classmethod
    def make(cls, folder: Path, start: str) -> RecordingRunc:
        path, log = folder / "recording-runc", folder / "hook-stages.log"
        path.write_text(RECORDING_RUNC.format(python=sys.executable, log=str(log),
                                              old=start != CREATE_RUNTIME))
        path.chmod(0o755)
        return cls(path, log, start)

    def creates(self) -> list[dict[str, list[str]]]:
        """Per container create: stage -> the hook's commands there."""
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def expected(self) -> dict[str, list[str]]:
        return {self.start: [self.start], "poststop": ["poststop"]}
