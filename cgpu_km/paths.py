"""Where the project's built, non-Python parts are.

A source checkout keeps them beside the package (`<repo>/libcgpu/libcgpu.so`,
`<repo>/simgpu/`). `cgpu-node install` copies them into its prefix, beside
the venv the programs run from (`/opt/cgpu_km/lib/libcgpu.so`,
`/opt/cgpu_km/simgpu/`, `/opt/cgpu_km/venv`). The environment overrides
both: `CGPU_LIBCGPU` names the library, `CGPU_SIMGPU_DIR` simgpu's folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

LIBCGPU_ENV = "CGPU_LIBCGPU"
SIMGPU_DIR_ENV = "CGPU_SIMGPU_DIR"
CHECKOUT = Path(__file__).resolve().parents[1]


def install_prefix() -> Path:
    """The prefix of an installed copy: the folder that holds this venv."""
    return Path(sys.prefix).parent


def _first_existing(*candidates: Path) -> Path:
    for candidate in candidates:
        if candidate.exists():
            return candidate
    return candidates[0]


def libcgpu() -> Path:
    """$CGPU_LIBCGPU, else the checkout's build, else the installed prefix's copy."""
    override = os.environ.get(LIBCGPU_ENV)
    if override:
        return Path(override)
    return _first_existing(CHECKOUT / "libcgpu" / "libcgpu.so",
                           install_prefix() / "lib" / "libcgpu.so")


def simgpu_dir() -> Path:
    """$CGPU_SIMGPU_DIR, else the checkout's simgpu/, else the installed prefix's."""
    override = os.environ.get(SIMGPU_DIR_ENV)
    if override:
        return Path(override)
    return _first_existing(CHECKOUT / "simgpu" / "libnvidia-ml.so.1",
                           install_prefix() / "simgpu" / "libnvidia-ml.so.1").parent
