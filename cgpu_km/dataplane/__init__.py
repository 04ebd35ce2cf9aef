"""The data plane's Python side: what the daemon and the registrars share with libcgpu.

- `region`: the ctypes mirror of `libcgpu/region.h` (control and account parts);
- `kernelview`: a container's identity as the kernel sees it, and which container
  a process belongs to;
- `futex`: waking and waiting on the regions' futex words.
"""
