"""Issue 36, item 7: containers that share one pid namespace, under runc and the daemon.

Kubernetes' shareProcessNamespace and Docker's `--pid=container:X` put several
containers in one pid namespace, each in a cgroup of its own. The daemon
mapped each pid namespace to one container (whichever a set's order gave),
so the processes of one were counted in the other's account, where they had
no slot: an honest libcgpu process was stopped as one that bypassed libcgpu
1.9 s after its neighbour's process started. Here the second container joins
the first's pid namespace (runc's `namespaces: [{"type": "pid", "path":
"/proc/<pid>/ns/pid"}]`); both are managed with their own limits, and each
one's processes are its own: counted in its own meminfo, never stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping

import pytest

from cgpu_km.dataplane import kernelview
from tests.attacks.node import MIB, VENV_BIN, Container, Node, missing
from tests.attacks.test_backstop import cgpu_mem

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing()))]


def joining(node: Node, env: Mapping[str, str], neighbour: Container,
            monkeypatch: pytest.MonkeyPatch) -> Container:
    """A container started in `neighbour`'s pid namespace (a cgroup of its own)."""
    config_of = node._config

    def config(*args: object) -> dict[str, object]:
        found = config_of(*args)  # type: ignore[arg-type]
        linux = found["linux"]
        assert isinstance(linux, dict)
        for space in linux["namespaces"]:
            if space["type"] == "pid":
                space["path"] = f"/proc/{neighbour.init_pid()}/ns/pid"
        return found

    with monkeypatch.context() as patch:
        patch.setattr(node, "_config", config)
        return node.container(env)


def smi_containers(node: Node) -> dict[str, dict[str, object]]:
    """`cgpu-smi --json`'s containers on GPU 0, by name."""
    out = subprocess.run([str(VENV_BIN / "cgpu-smi"), "--json", "--root", str(node.tree),
                          "--state-dir", str(node.state_dir)], env=node.env,
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return {c["name"]: c for c in json.loads(out)["gpus"][0]["containers"]}


def test_two_runc_containers_in_one_pid_namespace_each_keep_their_own(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both registered with their own limits (512 and 1024 MiB); each one's libcgpu
    process holds memory through several memory rounds, more each round. Each is in its
    own container's meminfo, neither is stopped (as a bypass or for memory), and the
    daemon's counters say so."""
    node.start_daemon()
    first = node.container(cgpu_mem(512))
    second = joining(node, cgpu_mem(1024), first, monkeypatch)
    assert second.pidns() == first.pidns()
    owners = [kernelview.read_owner(c.region_path) for c in (first, second)]
    assert owners[0] is not None
    assert owners[1] is not None
    assert owners[0].pidns == owners[1].pidns
    assert owners[0].cgroups != owners[1].cgroups, "a cgroup of its own"
    a, b = first.proc(), second.proc()
    assert a.pid != b.pid
    held = {a: 0, b: 0}
    for step in (100 * MIB, 50 * MIB, 50 * MIB):
        for proc, size in ((a, step), (b, 2 * step)):
            assert proc.ask(f"alloc {size}") == "alloc rc=0"
            held[proc] += size
        node.backstop_rounds(2)  # each round measured, stopped (had it to) and fed meminfo
        assert node.meminfo(first) == (512 * MIB - held[a], {a.host_pid: held[a]})
        assert node.meminfo(second) == (1024 * MIB - held[b], {b.host_pid: held[b]})
    assert a.alive()
    assert b.alive()
    log = node.sim.daemon_log()
    assert "without libcgpu" not in log
    assert "over its limit" not in log
    smi = smi_containers(node)
    for container, proc in ((first, a), (second, b)):
        row = smi[container.id12]
        assert (row["bypass_stops"], row["oom_events"]) == (0, 0)
        assert row["processes"] == [{"pid": proc.host_pid, "memory_bytes": held[proc],
                                     "managed": True}]


def test_a_process_of_the_namespace_in_neither_cgroup_is_nobodys(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """A third container joins the namespace unregistered (no GPU variables: the hook
    leaves it alone): its GPU process is in neither registered container's cgroup, so it
    is counted in neither and stops nobody, though the namespace is theirs."""
    node.start_daemon()
    first = node.container(cgpu_mem(512))
    second = joining(node, cgpu_mem(512), first, monkeypatch)
    stranger = joining(node, {}, first, monkeypatch)
    assert not stranger.region_path.exists()
    a, b = first.proc(), second.proc()
    other = stranger.proc()
    assert a.ask(f"alloc {100 * MIB}") == "alloc rc=0"
    assert b.ask(f"alloc {100 * MIB}") == "alloc rc=0"
    assert other.ask(f"alloc {600 * MIB}") == "alloc rc=0"  # no libcgpu, no limit
    node.backstop_rounds(3)
    assert node.meminfo(first) == (412 * MIB, {a.host_pid: 100 * MIB})
    assert node.meminfo(second) == (412 * MIB, {b.host_pid: 100 * MIB})
    assert all(p.alive() for p in (a, b, other))
    assert os.path.exists(f"/proc/{other.host_pid}")
    log = node.sim.daemon_log()
    assert "without libcgpu" not in log
    assert "over its limit" not in log
