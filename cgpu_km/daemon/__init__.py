"""`cgpu-daemon`: the host daemon, one module per service and its pure cores.

Services, each a task with its own worker thread and schedule:
- `treesync`: the view of the control tree, pushed into the data plane;
- `regions`: new containers' regions attached, dead processes' slots freed;
- `memory`: GPU memory by container fed into the tree, and the backstop;
- `publishing`: the snapshot for cgpu-smi and Prometheus, the state file;
- `lifecycle`: systemd, signals, the hot update.
`core` composes them, `cli` is the program, `context` what they share.

Beneath them: `sched` (the scheduler's pure core), `dispatch` (one thread
per GPU driving it over the regions), `plane` and `registry` (the data
plane and its regions), `backstop` (memory by container, stopping), `edges`
(the interfaces to the tree and the plane), `snapshot`, `metrics`, `sdnotify`.
"""
