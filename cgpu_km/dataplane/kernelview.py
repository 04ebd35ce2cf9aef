"""Processes as the kernel sees them: which container a host process belongs to.

Nothing a container writes is believed here. A container's identity (`Owner`)
is read from /proc at registration, from a process the registrar started
itself: the container's init at the OCI hook (createRuntime or prestart,
both before the init's pivot_root), or `cgpu-run`'s job.
It is the init's pid namespace and cgroup, which its processes cannot leave:
runc gives them no CAP_SYS_ADMIN, and the cgroup file system is read-only
inside. A host process belongs to the container when its pid namespace is
the container's (or nested in it) and its cgroup is the container's (or
below it): both must agree where the container has both, so containers
that share one pid namespace each have their own processes, and a host
process moved into a container's cgroup is not the container's. The
host's own pid namespace and root cgroup identify nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator, Mapping, Set
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cgpu_km.fileio import replace_file

PROC = "/proc"
NS_GET_PARENT = 0xB702  # _IO(0xb7, 0x2), linux/nsfs.h
OWNER_NAME = "owner.json"


@dataclass(frozen=True)
class ProcessInfo:
    """One process, read from /proc/<pid> (the reader's view: host pids)."""

    pid: int
    pidns: int  # inode of its pid namespace
    inner_pid: int  # its pid in that namespace (last NSpid field)
    start_time: int  # field 22 of stat: clock ticks after boot
    uid: int  # real uid
    gid: int
    cgroups: Mapping[str, str] = field(default_factory=dict)  # "id:controllers" -> path
    cap_bounding: int = 0  # CapBnd
    state: str = "R"


@dataclass(frozen=True)
class Owner:
    """A container's identity: its init's pid namespace and cgroups."""

    pidns: int
    cgroups: Mapping[str, str]
    pid: int = 0  # the init's host pid, when it was read
    start_time: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Owner:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not an object")
        cgroups = data.get("cgroups", {})
        if not isinstance(cgroups, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in cgroups.items()):
            raise ValueError("cgroups is not a map of strings")
        return cls(pidns=int(data["pidns"]), cgroups=cgroups, pid=int(data.get("pid", 0)),
                   start_time=int(data.get("start_time", 0)))


def parse_stat(text: str) -> tuple[str, int]:
    """(state letter, start time) from the text of /proc/<pid>/stat."""
    rest = text[text.rindex(")") + 2:].split()
    return rest[0], int(rest[19])


def parse_cgroups(text: str) -> dict[str, str]:
    """`/proc/<pid>/cgroup` as {"hierarchy-id:controllers": path}."""
    found = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            found[f"{parts[0]}:{parts[1]}"] = parts[2]
    return found


def parse_status(text: str) -> dict[str, str]:
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def read_proc(path: str) -> str:
    """The text of a /proc file. Some of it is a process's own (its name, its
    cgroup's), any bytes it likes: those that are not UTF-8 are kept as
    surrogates, never an error that would make the process look gone. Read with
    plain system calls (no buffered file: a third of the calls, 64 a second on a
    busy node)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
    finally:
        os.close(fd)
    return data.decode(errors="surrogateescape")


def process_state(pid: int, proc: str = PROC) -> tuple[str, int] | None:
    """(state letter, start time) of a process, from its stat alone; None when gone."""
    try:
        return parse_stat(read_proc(f"{proc}/{pid}/stat"))
    except (OSError, ValueError, IndexError):
        return None


def still_runs(info: ProcessInfo, proc: str = PROC) -> bool:
    """Whether the process `info` was read of runs yet, by its stat alone: its
    host pid names a process of the same start time, not a zombie."""
    state = process_state(info.pid, proc)
    return state is not None and state[1] == info.start_time and state[0] not in ("Z", "X")


def process_info(pid: int, proc: str = PROC) -> ProcessInfo | None:
    """What the kernel says of a process, or None when it is gone."""
    base = f"{proc}/{pid}"
    try:
        pidns = os.stat(f"{base}/ns/pid").st_ino
        state, start = parse_stat(read_proc(f"{base}/stat"))
        status = parse_status(read_proc(f"{base}/status"))
        cgroups = parse_cgroups(read_proc(f"{base}/cgroup"))
    except (OSError, ValueError, IndexError):
        return None
    try:
        inner = int(status.get("NSpid", str(pid)).split()[-1])
        uid = int(status["Uid"].split()[0])
        gid = int(status["Gid"].split()[0])
        bounding = int(status.get("CapBnd", "0"), 16)
    except (KeyError, ValueError, IndexError):
        return None
    return ProcessInfo(pid=pid, pidns=pidns, inner_pid=inner, start_time=start, uid=uid,
                       gid=gid, cgroups=cgroups, cap_bounding=bounding, state=state)


def owner_of(pid: int, proc: str = PROC, *, cgroups: bool = True) -> Owner | None:
    """The identity of the container whose init is host pid `pid` (its pid
    namespace, and its cgroups unless the caller knows they are not its own)."""
    info = process_info(pid, proc)
    if info is None:
        return None
    return Owner(pidns=info.pidns, cgroups=dict(info.cgroups) if cgroups else {}, pid=pid,
                 start_time=info.start_time)


def host_pidns(proc: str = PROC) -> int:
    """The pid namespace of the reader (the daemon runs in the host's)."""
    return os.stat(f"{proc}/self/ns/pid").st_ino


def host_cgroups(proc: str = PROC) -> dict[str, set[str]]:
    """The cgroups of pid 1 and of the reader: paths that identify nothing."""
    found: dict[str, set[str]] = {}
    for pid in ("1", "self"):
        try:
            for key, path in parse_cgroups(read_proc(f"{proc}/{pid}/cgroup")).items():
                found.setdefault(key, set()).add(path)
        except OSError:
            continue
    return found


def pidns_ancestors(pid: int, proc: str = PROC, limit: int = 32) -> list[int]:
    """Inodes of the pid namespaces above the one of `pid`, innermost first."""
    found: list[int] = []
    try:
        fd = os.open(f"{proc}/{pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return found
    try:
        for _ in range(limit):
            try:
                parent = fcntl.ioctl(fd, NS_GET_PARENT)
            except OSError:
                break  # the top, or a namespace the reader may not see above
            os.close(fd)
            fd = parent
            found.append(os.fstat(fd).st_ino)
    finally:
        os.close(fd)
    return found


@dataclass(frozen=True)
class Host:
    """What identifies nothing: the reader's pid namespace, and the cgroups of
    pid 1 and of the reader."""

    pidns: int
    cgroups: Mapping[str, Set[str]]

    @classmethod
    def read(cls, proc: str = PROC) -> Host:
        return cls(host_pidns(proc), host_cgroups(proc))


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _pidns_known(owner: Owner, host: Host) -> bool:
    """Whether the owner's pid namespace identifies it (not unknown, not the host's)."""
    return bool(owner.pidns) and owner.pidns != host.pidns


def _cgroups_known(owner: Owner, host: Host) -> dict[str, str]:
    """The owner's cgroups that identify it: not the root, not the host's own."""
    return {key: top for key, top in owner.cgroups.items()
            if top not in ("", "/") and top not in host.cgroups.get(key, ())}


def _cgroup_depth(info: ProcessInfo, cgroups: Mapping[str, str]) -> int:
    """How closely these cgroups hold the process: the length of the longest one
    it is in (or below), -1 when it is in none of them."""
    depth = -1
    for key, top in cgroups.items():
        path = info.cgroups.get(key)
        if path is not None and _under(path, top):
            depth = max(depth, len(top.rstrip("/")))
    return depth


def belongs(info: ProcessInfo, owner: Owner, host: Host, proc: str = PROC) -> bool:
    """Whether the kernel puts this process in the container `owner` names.

    The pid namespace and the cgroup must both agree where both are known: the
    process's pid namespace is the container's (or nested in it), and its
    cgroup is one of the container's (or below it). A container that shares
    its pid namespace with others (Kubernetes' shareProcessNamespace, Docker's
    `--pid=container:`) has its own processes by its cgroup, and a host
    process moved into a container's cgroup is not the container's. Where the
    owner knows only one of them (`cgpu-run` records no cgroup; a container
    in the host's pid namespace has none of its own), that one decides."""
    pidns_known = _pidns_known(owner, host)
    cgroups = _cgroups_known(owner, host)
    if not pidns_known and not cgroups:
        return False
    if pidns_known and not (info.pidns == owner.pidns or (
            info.pidns != host.pidns and owner.pidns in pidns_ancestors(info.pid, proc))):
        return False
    return not cgroups or _cgroup_depth(info, cgroups) >= 0


class OwnerIndex:
    """Containers by what identifies them, to find a process's container fast:
    one dictionary lookup by pid namespace, the namespaces above it only when
    that finds none, then the cgroups. The same answers as `belongs`: a
    process is the container's that `belongs` puts it in. When several do
    (containers that share a pid namespace with a cgroup below another's),
    the one of its innermost pid namespace, then the one whose cgroup holds
    it most closely; when that still leaves two, it is nobody's: never
    guessed."""

    def __init__(self, owners: Mapping[str, Owner], host: Host, proc: str = PROC) -> None:
        self.host = host
        self.proc = proc
        # pid namespace -> [(name, the cgroups that identify it)]
        self.by_pidns: dict[int, list[tuple[str, dict[str, str]]]] = {}
        # containers known by their cgroups alone (in the host's pid namespace)
        self.by_cgroup: list[tuple[str, dict[str, str]]] = []
        for name, owner in owners.items():
            cgroups = _cgroups_known(owner, host)
            if _pidns_known(owner, host):
                self.by_pidns.setdefault(owner.pidns, []).append((name, cgroups))
            elif cgroups:
                self.by_cgroup.append((name, cgroups))

    @staticmethod
    def _closest(info: ProcessInfo, owners: list[tuple[str, dict[str, str]]]
                 ) -> tuple[bool, str | None]:
        """(whether any of `owners` holds the process, the one that holds it
        most closely: None when two hold it alike)."""
        best, name, tied = -2, None, False
        for candidate, cgroups in owners:
            depth = _cgroup_depth(info, cgroups) if cgroups else -1
            if depth < 0 and cgroups:
                continue
            if depth > best:
                best, name, tied = depth, candidate, False
            elif depth == best and candidate != name:
                tied = True
        return best > -2, None if tied else name

    def find(self, info: ProcessInfo) -> str | None:
        held, name = self._closest(info, self.by_pidns.get(info.pidns, []))
        if not held and info.pidns != self.host.pidns and self.by_pidns:
            for pidns in pidns_ancestors(info.pid, self.proc):
                held, name = self._closest(info, self.by_pidns.get(pidns, []))
                if held:
                    break
        if not held:
            held, name = self._closest(info, self.by_cgroup)
        return name


def all_pids(proc: str = PROC) -> Iterator[int]:
    for entry in os.scandir(proc):
        if entry.name.isdigit():
            yield int(entry.name)


def write_owner(region: Path, owner: Owner) -> None:
    """Record a container's identity next to its region (root only)."""
    replace_file(region / OWNER_NAME, owner.to_json(), 0o600)


def read_owner(region: Path) -> Owner | None:
    """A region's recorded identity, or None when there is none (or it is unreadable)."""
    try:
        return Owner.from_json((region / OWNER_NAME).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
