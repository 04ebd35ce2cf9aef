"""`cgpu-daemon`: the host daemon, one module per service and its pure cores.

- `core`: the daemon's services and lifecycle (tree, regions, memory, slots,
  publishing, systemd), the program's command line;
- `sched`: the scheduler's pure core (allotments, exclusive slices);
- `dispatch`: one thread per GPU driving `sched` over the regions;
- `plane`, `registry`: the data plane the services drive, and the regions;
- `backstop`: GPU memory by container from NVML and the kernel, and stopping;
- `edges`: the interfaces the services talk to (tree, plane), and the real tree;
- `snapshot`, `metrics`, `sdnotify`: what it publishes, and to whom.
"""
