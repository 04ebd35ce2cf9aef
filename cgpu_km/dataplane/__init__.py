"""The data plane's host side: the regions libcgpu shares with the daemon, and what
drives them.

- `region`: the ctypes mirror of `libcgpu/region.h` (control and account parts);
- `registry`: which regions are attached, one per container, with its owner;
- `dispatch`: one dispatcher thread per GPU, stepping `cgpu_km.sched` over the
  regions' gates and doorbells;
- `plane`: `RegionPlane`, the daemon's `Plane` port over all of them;
- `attribution`: GPU memory by container, from NVML and the kernel;
- `stopping`: stopping a process (the eGPU OOM script, then SIGKILL);
- `kernelview`: a container's identity as the kernel sees it, and which container
  a process belongs to;
- `futex`: waking and waiting on the regions' futex words.
"""
