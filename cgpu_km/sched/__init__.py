"""The compute scheduler's pure core: no I/O, no clock, no threads.

- `allotments`: what part of a GPU each container is owed (the policy table);
- `slices`: the exclusive time slices that deliver it, one `SliceScheduler`
  per GPU, stepped by the data plane's dispatcher (or a simulation in tests).
"""

from cgpu_km.sched.allotments import (
    Allotment,
    ContainerSpec,
    GpuConfig,
    Policy,
    allotments,
    waterfill,
)
from cgpu_km.sched.slices import (
    NOTHING,
    QUANTUM,
    IdleWatch,
    Observation,
    ProcessRests,
    SliceDecision,
    SliceScheduler,
)

__all__ = [
    "NOTHING",
    "QUANTUM",
    "Allotment",
    "ContainerSpec",
    "GpuConfig",
    "IdleWatch",
    "Observation",
    "Policy",
    "ProcessRests",
    "SliceDecision",
    "SliceScheduler",
    "allotments",
    "waterfill",
]
