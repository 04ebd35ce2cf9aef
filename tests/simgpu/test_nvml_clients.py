"""Real NVML clients run on simgpu: nvitop and gpustat, unmodified, with no traceback.

simgpu's NVML answers NVML_ERROR_NOT_SUPPORTED for what it has no model of, as
the driver does for a feature a device lacks; a missing entry point would be
NVML_ERROR_FUNCTION_NOT_FOUND instead, which these clients print as a traceback.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cgpu_km.gpus import with_simgpu_libraries
from tests.simgpu.simhost import SimHost

VENV_BIN = Path(sys.executable).parent
CLIENTS = ("nvitop", "gpustat")
MIB = 1 << 20


def _site() -> Path:
    spec = importlib.util.find_spec("pynvml")
    assert spec is not None
    assert spec.origin is not None
    return Path(spec.origin).parent


def entry_points_used() -> set[str]:
    """The C entry points behind every nvidia-ml-py function that nvitop or gpustat
    names, and behind nvmlInit and nvmlShutdown."""
    source = (_site() / "pynvml.py").read_text()
    bodies = {node.name: ast.get_source_segment(source, node) or ""
              for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}

    def entry_points(name: str) -> set[str]:
        body = bodies.get(name, "")
        found = set(re.findall(r'_nvmlGetFunctionPointer\("(nvml\w+)"\)', body))
        for called in set(re.findall(r"\b(nvml[A-Z]\w+)\(", body)) - {name}:
            found |= set(re.findall(r'_nvmlGetFunctionPointer\("(nvml\w+)"\)',
                                    bodies.get(called, "")))
        return found

    named = {"nvmlInit", "nvmlInitWithFlags", "nvmlShutdown", "nvmlErrorString"}
    for client in CLIENTS:
        for path in (_site() / client).rglob("*.py"):
            named |= set(re.findall(r"\b(nvml[A-Z]\w+)", path.read_text()))
    return set().union(*(entry_points(name) for name in named))


def exported(library: Path) -> set[str]:
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True,
                             text=True, check=True).stdout
    return {line.split()[-1] for line in symbols.splitlines() if " T " in line}


def test_simgpu_exports_every_entry_point_the_clients_use(sim: SimHost) -> None:
    wanted = entry_points_used()
    assert {"nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetMemoryInfo_v2"} <= wanted
    assert wanted - exported(sim.lib_dir / "libnvidia-ml.so.1") == set()


def run_client(sim: SimHost, *command: str) -> str:
    env = with_simgpu_libraries(sim.env(), sim.lib_dir)
    done = subprocess.run([str(VENV_BIN / command[0]), *command[1:]], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Traceback" not in output, output
    return output


@pytest.mark.parametrize("command", [("nvitop", "-1"), ("gpustat", "-cupF"),
                                     ("gpustat", "--json")], ids=" ".join)
def test_clients_show_simgpu_devices_and_processes(sim: SimHost, command: tuple[str, ...]
                                                   ) -> None:
    holder = sim.start("--alloc", str(64 * MIB), "--hold-stdin")
    output = run_client(sim, *command)
    assert "Tesla T4" in output, output
    assert "V100" in output, output  # nvitop shortens the name
    assert str(holder.ready["pid"]) in output, output  # the process holding memory
