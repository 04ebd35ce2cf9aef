"""Reading runtime command lines as docker, containerd and podman write them."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from cgpu_km.container.oci.argv import Invocation, parse_argv

CWD = Path("/run/bundle-cwd")


def test_docker_create() -> None:
    argv = ["--root", "/var/run/docker/runtime-runc/moby", "--log",
            "/run/containerd/io.containerd.runtime.v2.task/moby/abc/log.json", "--log-format",
            "json", "--systemd-cgroup", "create", "--bundle",
            "/run/containerd/io.containerd.runtime.v2.task/moby/abc", "--pid-file",
            "/run/containerd/io.containerd.runtime.v2.task/moby/abc/init.pid", "abc"]
    assert parse_argv(argv, CWD) == Invocation(
        command="create", bundle=Path("/run/containerd/io.containerd.runtime.v2.task/moby/abc"),
        process=None, log=Path("/run/containerd/io.containerd.runtime.v2.task/moby/abc/log.json"),
        log_format="json")


def test_equals_single_dash_short_and_default_bundle() -> None:
    assert parse_argv(["-log=l.json", "create", "-b=b", "x"], CWD).bundle == CWD / "b"
    assert parse_argv(["create", "-b", "/abs", "x"], CWD).bundle == Path("/abs")
    assert parse_argv(["create", "--pid-file", "p", "x"], CWD).bundle == CWD
    invocation = parse_argv(["--log", "rel.log", "run", "--bundle=/b", "x"], CWD)
    assert (invocation.command, invocation.bundle, invocation.log) == \
        ("run", Path("/b"), CWD / "rel.log")
    assert invocation.log_format == "text"


def test_exec_and_others() -> None:
    exec_ = parse_argv(["--root", "r", "exec", "--process", "/tmp/p.json", "--detach",
                        "--pid-file", "x", "id"], CWD)
    assert (exec_.command, exec_.process, exec_.bundle) == ("exec", Path("/tmp/p.json"), None)
    assert parse_argv(["--root", "r", "delete", "--force", "id"], CWD).command == "delete"
    assert parse_argv(["--version"], CWD).command is None
    assert parse_argv([], CWD).command is None
    assert parse_argv(["start", "--bundle", "b", "id"], CWD).bundle is None


VALUED = st.sampled_from(["--root", "--log", "--log-format", "--criu", "--rootless"])
SWITCH = st.sampled_from(["--debug", "--systemd-cgroup"])
WORD = st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=8)
COMMAND = st.sampled_from(["create", "start", "kill", "delete", "state", "exec", "run", "ps"])


@given(st.lists(st.one_of(st.tuples(VALUED, WORD), st.tuples(SWITCH)), max_size=6), COMMAND,
       WORD)
def test_global_options_never_hide_the_command(
        options: list[tuple[str, ...]], command: str, bundle: str) -> None:
    argv = [word for option in options for word in option] + [command, "--bundle", bundle, "id"]
    invocation = parse_argv(argv, CWD)
    assert invocation.command == command
    assert invocation.bundle == (CWD / bundle if command in ("create", "run") else None)
