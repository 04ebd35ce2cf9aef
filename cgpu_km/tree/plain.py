"""cgpu-plaintree: the control tree as plain files, for hosts where FUSE cannot mount.

    python3 -m cgpu_km.tree.plain --root DIR [--gpus N] [cgpu-fuse's options]

It serves the same `cgpu_km.tree.model.ControlTree` as `cgpu-fuse`, without a
mount: every node is a regular file holding what a read of it returns, kept
up to date by this process, and `inst_ctl` is a FIFO this process reads.
Every tool that reaches the tree through files (`cgpu-run`, `cgpu-daemon`,
`cgpu-smi`, `cat`, `echo`) works on it unchanged.

How it differs from the FUSE tree and the module (why it is a fallback):
- A command or a node write takes effect when this process wakes for it
  (inotify and the FIFO wake it; `--interval`, 20 ms, bounds its sleep),
  not before the writer's `write` returns. A writer that reads back at once
  may see the old state; `cgpu-run` with `--memsize` does not read back.
- A refused command or write is not returned to the writer: it is logged on
  stderr and the node's file is put back to the tree's value.
- `inst_ctl` takes one command per line (writers of `cgpu_km.tree.client` end
  each command with a newline); a partial line is taken as a command once
  the FIFO has been quiet for 0.1 s.
Files are replaced atomically (a write to `.staging/` and a rename), and a
new container's directory appears with all its nodes at once. Writes to the
nodes are found by inotify on their directories, so a write lands however
soon it follows the last one. On exit the files are removed, so
`test -e <root>/inst_ctl` means the tree is served.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from cgpu_km.tree.model import ControlTree, TreeError, add_tree_arguments, tree_from_arguments
from cgpu_km.tree.nodes import NODES_BY_LEVEL, Kind, Level
from cgpu_km.tree.watch import FILE_WRITES, IN_IGNORED, IN_Q_OVERFLOW, Inotify

STAGING = ".staging"
PARTIAL_COMMAND_WAIT = 0.1  # seconds of quiet after which a line without newline is taken
_WRITABLE = {
    level: [n.name for n in nodes.values() if n.writable and n.kind is not Kind.COMMAND]
    for level, nodes in NODES_BY_LEVEL.items()
}


class PlainTree:
    """Mirror a `ControlTree` into plain files; apply commands and node writes to it."""

    def __init__(self, root: Path, tree: ControlTree) -> None:
        self.root = root
        self.tree = tree
        self.staging = root / STAGING
        self.fifo = root / "inst_ctl"
        self.rendered: dict[str, bytes] = {}  # relpath -> content we wrote
        self.inotify = Inotify()
        self.watched: dict[int, str] = {}  # watch descriptor -> directory relpath
        self.written: set[str] = set()  # writable node relpaths a writer may have changed
        self._serial = 0

    # -- files ----------------------------------------------------------------

    def _stage(self) -> Path:
        self._serial += 1
        return self.staging / f"{os.getpid()}.{self._serial}"

    def _mode(self, relpath: str) -> int:
        node = self.tree.lookup(relpath).node
        return node.mode if node is not None else 0o555

    def _put(self, relpath: str, content: bytes) -> None:
        """Replace one file atomically and remember what we wrote."""
        temporary = self._stage()
        temporary.write_bytes(content)
        temporary.chmod(self._mode(relpath))
        os.replace(temporary, self.root / relpath)
        self.rendered[relpath] = content

    def _watch(self, directory: str) -> None:
        """Watch a directory's node writes; a write made before the watch is looked for."""
        wd = self.inotify.add(str(self.root / directory), FILE_WRITES)
        if wd is not None:
            self.watched[wd] = directory
        self.written.update(_node_path(directory, name)
                            for name in _WRITABLE[_level_of_directory(directory)])

    def desired(self) -> dict[str, bytes]:
        """Every readable node's content, by relative path."""
        wanted: dict[str, bytes] = {}

        def walk(directory: str) -> None:
            for name in self.tree.listdir(directory):
                relpath = f"{directory}/{name}" if directory else name
                entry = self.tree.lookup(relpath)
                if entry.is_dir:
                    walk(relpath)
                elif entry.node is not None and entry.node.kind is not Kind.COMMAND:
                    wanted[relpath] = self.tree.read(relpath)

        walk("")
        return wanted

    def render(self) -> None:
        """Bring the files in line with the tree: new containers, gone ones, changed values."""
        wanted = self.desired()
        wanted_dirs = {p.rsplit("/", 1)[0] for p in wanted if p.count("/") == 2}
        had_dirs = {p.rsplit("/", 1)[0] for p in self.rendered if p.count("/") == 2}
        for directory in sorted(had_dirs - wanted_dirs):
            self._remove_dir(directory)
        for gpu in sorted({p.split("/", 1)[0] for p in wanted if "/" in p}):
            if not (self.root / gpu).is_dir():
                (self.root / gpu).mkdir(mode=0o555)
                self._watch(gpu)
        for directory in sorted(wanted_dirs - had_dirs):
            self._add_dir(directory, {p: c for p, c in wanted.items()
                                      if p.startswith(directory + "/")})
        for relpath, content in wanted.items():
            if self.rendered.get(relpath) != content:
                self._put(relpath, content)

    def _add_dir(self, directory: str, files: dict[str, bytes]) -> None:
        temporary = self._stage()
        temporary.mkdir()
        for relpath, content in files.items():
            path = temporary / relpath.rsplit("/", 1)[-1]
            path.write_bytes(content)
            path.chmod(self._mode(relpath))
        temporary.chmod(0o555)
        target = self.root / directory
        if target.exists():  # left over from a crashed predecessor
            shutil.rmtree(target)
        os.rename(temporary, target)
        self.rendered.update(files)
        self._watch(directory)

    def _remove_dir(self, directory: str) -> None:
        temporary = self._stage()
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.root / directory, temporary)
            shutil.rmtree(temporary)
        for relpath in [p for p in self.rendered if p.startswith(directory + "/")]:
            self.rendered.pop(relpath)
            self.written.discard(relpath)

    # -- what writers did ------------------------------------------------------

    def command(self, line: bytes) -> bool:
        """Apply one `inst_ctl` line; True when the tree changed."""
        if not line.strip():
            return False
        try:
            self.tree.write("inst_ctl", line)
        except TreeError as error:
            log(f"inst_ctl {line.strip()[:80]!r}: {_describe(error)}")
            return False
        return True

    def _note_writes(self) -> None:
        """Turn the queued inotify events into node paths to look at."""
        for wd, mask, name in self.inotify.events():
            if mask & IN_Q_OVERFLOW:  # events were dropped: look at every node
                self.written.update(p for p in self.rendered if _is_writable(p))
            elif mask & IN_IGNORED:
                self.watched.pop(wd, None)
            elif wd in self.watched:
                relpath = _node_path(self.watched[wd], name)
                if _is_writable(relpath):
                    self.written.add(relpath)

    def scan_writes(self) -> bool:
        """Apply node files that writers changed since we wrote them; True if any was seen."""
        self._note_writes()
        seen = False
        written, self.written = self.written, set()
        for relpath in sorted(written):
            if relpath not in self.rendered:
                continue  # its container went meanwhile
            try:
                content = (self.root / relpath).read_bytes()
            except FileNotFoundError:
                content = b""
            if not content or content == self.rendered[relpath]:
                continue  # unchanged, or `echo` truncated the file and has not written yet
            seen = True
            try:
                self.tree.write(relpath, content)
            except TreeError as error:
                log(f"{relpath} <- {content.strip()[:40]!r}: {_describe(error)}; "
                    f"kept {self.rendered[relpath].strip()!r}")
            if self._reads(relpath) == content:
                # Already what the tree reads: rewriting it would race the next writer.
                self.rendered[relpath] = content
            else:
                self.rendered.pop(relpath)  # rewrite it with the tree's value
        return seen

    def _reads(self, relpath: str) -> bytes | None:
        try:
            return self.tree.read(relpath)
        except TreeError:
            return None

    # -- serving ----------------------------------------------------------------

    def start(self) -> int:
        """Lay out the files and the FIFO (last: its presence means served); the FIFO fd."""
        if self.root.is_mount():
            raise OSError(f"{self.root} is a mount point")
        self.root.mkdir(parents=True, exist_ok=True)
        leftovers = [p.name for p in self.root.iterdir()]
        if leftovers and STAGING not in leftovers:
            raise OSError(f"{self.root} is not empty (and not a plain tree)")
        self.clear()
        self.root.chmod(0o755)
        self.staging.mkdir(mode=0o700)
        self._watch("")
        self.render()
        temporary = self._stage()
        # Write-only, unlike the node's 0600: a read of the FIFO would take a
        # command meant for this process, so there is no usage line to read.
        os.mkfifo(temporary, 0o200)
        # O_RDWR: the FIFO always has a writer (us), so reads never see EOF and
        # writers' opens never block while we serve.
        fd = os.open(temporary, os.O_RDWR | os.O_NONBLOCK)
        os.rename(temporary, self.fifo)
        return fd

    def clear(self) -> None:
        """Remove everything this tree put under root (FIFO first: writers stop at once)."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISFIFO(os.lstat(self.fifo).st_mode):
                self.fifo.unlink()
        for path in list(self.root.iterdir()) if self.root.exists() else []:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        self.rendered.clear()
        self.written.clear()

    def close(self, fd: int) -> None:
        """Remove the tree (`clear`) and close the FIFO's `fd` and the inotify descriptor."""
        self.clear()
        self.inotify.close()
        os.close(fd)

    def serve(self, fd: int, stop: threading.Event, interval: float = 0.02) -> None:
        """Until `stop`: read commands from the FIFO, pick up node writes, re-render."""
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(self.inotify.fileno(), select.POLLIN)  # node writes wake it too
        pending = b""
        last_data = time.monotonic()
        while not stop.is_set():
            changed = False
            if any(ready == fd for ready, _events in poller.poll(int(interval * 1000))):
                with contextlib.suppress(BlockingIOError):
                    pending += os.read(fd, 1 << 16)
                last_data = time.monotonic()
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                changed |= self.command(line)
            if pending and time.monotonic() - last_data >= PARTIAL_COMMAND_WAIT:
                changed |= self.command(pending)
                pending = b""
            changed |= self.scan_writes()
            if changed:
                self.render()


def _level_of_directory(directory: str) -> Level:
    return (Level.ROOT, Level.GPU, Level.CONTAINER)[directory.count("/") + 1 if directory else 0]


def _node_path(directory: str, name: str) -> str:
    return f"{directory}/{name}" if directory else name


def _is_writable(relpath: str) -> bool:
    directory, _, name = relpath.rpartition("/")
    return name in _WRITABLE[_level_of_directory(directory)]


def _describe(error: TreeError) -> str:
    return f"{os.strerror(error.errno or 0)} ({error.strerror})"


def log(message: str) -> None:
    print(f"cgpu-plaintree: {message}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cgpu-plaintree", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="/run/cgpu_km", help="folder (default %(default)s)")
    add_tree_arguments(parser)
    parser.add_argument("--interval", type=float, default=0.02, help="poll seconds")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        tree = tree_from_arguments(args)
        if not 0 < args.interval <= 1:
            raise ValueError(f"--interval must be in (0, 1] seconds, not {args.interval}")
    except ValueError as error:
        log(str(error))
        return 2
    plain = PlainTree(Path(args.root), tree)
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    try:
        fd = plain.start()
    except OSError as error:
        log(f"cannot serve {args.root}: {error}")
        return 1
    log(f"serving {args.root} ({args.gpus} GPUs) as plain files")
    try:
        plain.serve(fd, stop, args.interval)
    finally:
        plain.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
