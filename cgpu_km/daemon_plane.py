"""The real data plane for the daemon: containers' regions (gates, activity) and NVML.

Filled in by `make_plane`; see `cgpu_km.daemon_io.Plane` for the contract.
"""

from __future__ import annotations

from cgpu_km.daemon_io import OpenPlane, Plane


def make_plane(region_dir: str | None) -> Plane:
    return OpenPlane()
