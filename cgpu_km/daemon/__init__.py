"""`cgpu-daemon`: the host daemon, one module per service and its pure cores.

Services, each a task with its own worker thread and schedule:
- `treesync`: the view of the control tree, pushed into the data plane,
  and the containers' regions attached;
- `regions`: the reclaim service, which frees dead processes' slots;
- `memory`: GPU memory by container fed into the tree, and the backstop;
- `compute`: the check that no process used GPU time beyond its grants;
- `stops`: every stop of a process, each in a task of its own;
- `publishing`: the snapshot for cgpu-smi and Prometheus, the state file;
- `lifecycle`: systemd, signals, the hot update.
`core` composes them, `cli` is the program, `context` what they share.

Beside them: `edges` (the ports: the interfaces to the tree and the data
plane, whose real implementations are in `cgpu_km.tree` and
`cgpu_km.dataplane`), `backstop` (the memory rules, pure), `snapshot`,
`metrics`, `sdnotify`. The scheduler's pure core is `cgpu_km.sched`.
"""
