"""The control tree: one node table, its state model, the clients every tool reads and
writes it with, the mount-free tree, and the kernel module's generated header.

- `nodes`: the table (names, modes, ranges, defaults) that everything is built from;
- `model`: the tree's state and the parsing of writes, pure (FUSE serves it);
- `client`: reading and writing a mounted tree (`/proc/cgpu_km`, FUSE, mount-free);
- `fstree`, `watch`, `views`: the daemon's reader of a mounted tree, its inotify
  watcher, and the values they return;
- `plain`: the mount-free tree, plain files kept current by one process;
- `kmod_header`: `kmod/cgpu_km_nodes.h` from the table.
"""
