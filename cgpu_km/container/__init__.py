"""Containers: what the OCI hook, the runtime wrapper and `cgpu-run` do for one.

- `envplan`: the cGPU and eGPU environment variables resolved into a plan (pure);
- `hook`: `cgpu-hook`, registration and the data plane at createRuntime (or
  prestart) and poststop;
- `claims`: which container an id in the tree belongs to (restarts are idempotent);
- `inject`: the region and libcgpu inside the container's mount namespace;
- `oci`: `cgpu-container-runtime`, the wrapper in front of runc;
- `run`: `cgpu-run`, a transient container on a bare host, and `jobinit`, its
  pid namespace's first process;
- `nsexec`: running a program inside a container, as one of its processes (the
  eGPU OOM script).
"""
