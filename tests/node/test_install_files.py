"""cgpu-node on a node's files (no engines running, no prefix built): the round
trip byte for byte, installing twice, edits made after the install kept, bad
input changes nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cgpu_km.container.oci.settings import load_settings
from cgpu_km.node import cli
from cgpu_km.node import install as install_mod

DAEMON_JSON = b'{"log-level":"warn",\n "runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime"}}}'  # noqa: E501
CONTAINERD = b"version = 2\n# a comment that a TOML writer would drop\n[plugins]\n"
HOOK_FILE = b'{"version": "1.0.0", "hook": {"path": "/usr/bin/other-hook"}}\n'


@pytest.fixture
def node(tmp_path: Path) -> Path:
    (tmp_path / "etc" / "docker").mkdir(parents=True)
    (tmp_path / "etc" / "docker" / "daemon.json").write_bytes(DAEMON_JSON)
    os.chmod(tmp_path / "etc" / "docker" / "daemon.json", 0o600)
    (tmp_path / "etc" / "containerd").mkdir()
    (tmp_path / "etc" / "containerd" / "config.toml").write_bytes(CONTAINERD)
    hooks = tmp_path / "etc" / "containers" / "oci" / "hooks.d"
    hooks.mkdir(parents=True)
    (hooks / "other.json").write_bytes(HOOK_FILE)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "cgpu-hook").write_text("#!/bin/sh\n# an older copy\n")
    return tmp_path


def snapshot(folder: Path) -> dict[str, tuple[bytes | str, int]]:
    result: dict[str, tuple[bytes | str, int]] = {}
    for path in sorted(folder.rglob("*")):
        mode = path.lstat().st_mode
        if path.is_symlink():
            result[str(path.relative_to(folder))] = (os.readlink(path), mode)
        elif path.is_file():
            result[str(path.relative_to(folder))] = (path.read_bytes(), mode)
        else:
            result[str(path.relative_to(folder))] = ("<dir>", mode)
    return result


def install(node: Path, *extra: str) -> int:
    return cli.main(["install", "--no-build", "--engines", "docker,containerd,podman",
                     "--etc", str(node / "etc"), "--bin-dir", str(node / "bin"),
                     "--prefix", str(node / "opt"), "--state-dir", str(node / "state"),
                     "--no-services", "--docker-pidfile", str(node / "none.pid"), *extra])


def uninstall(node: Path) -> int:
    return cli.main(["uninstall", "--state-dir", str(node / "state")])


def test_round_trip_restores_every_byte(node: Path) -> None:
    before = snapshot(node)
    assert install(node, "--docker-default", "--nvidia-name") == 0
    daemon = json.loads((node / "etc" / "docker" / "daemon.json").read_text())
    assert daemon["default-runtime"] == "cgpu"
    assert daemon["runtimes"]["nvidia"]["path"] == str(node / "bin" / "cgpu-container-runtime")
    assert (node / "etc" / "docker" / "daemon.json").stat().st_mode & 0o777 == 0o600
    runtime = (node / "etc" / "cgpu_km" / "runtime.toml").read_text()
    assert 'runtimes = ["/usr/bin/nvidia-container-runtime", "nvidia-container-runtime", ' \
        '"runc"]' in runtime
    assert (node / "bin" / "cgpu-hook").is_symlink()
    assert sorted(p.name for p in (node / "etc" / "systemd" / "system").iterdir()) == [
        "cgpu-daemon.service", "cgpu-fuse.service", "cgpu-kmod.service"]
    unit = (node / "etc" / "systemd" / "system" / "cgpu-daemon.service").read_text()
    assert f"ExecStart={node / 'bin' / 'cgpu-daemon'} " in unit
    assert uninstall(node) == 0
    assert snapshot(node) == before


def test_installing_twice_keeps_the_first_originals(node: Path) -> None:
    before = snapshot(node)
    assert install(node, "--nvidia-name") == 0
    assert install(node) == 0  # again, now without the nvidia name
    daemon = json.loads((node / "etc" / "docker" / "daemon.json").read_text())
    assert daemon["runtimes"]["nvidia"] == {"path": "/usr/bin/nvidia-container-runtime"}
    assert uninstall(node) == 0
    assert snapshot(node) == before


def test_changes_made_after_the_install_are_kept(node: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert install(node) == 0
    path = node / "etc" / "docker" / "daemon.json"
    daemon = json.loads(path.read_text())
    daemon["debug"] = True
    path.write_text(json.dumps(daemon))
    assert uninstall(node) == 0
    assert json.loads(path.read_text()) == {**json.loads(DAEMON_JSON), "debug": True}
    assert "changed since the install: took cgpu's entries out, kept the rest" in \
        capsys.readouterr().out
    assert (node / "etc" / "containerd" / "config.toml").read_bytes() == CONTAINERD


@pytest.mark.parametrize(("breakage", "message"), [
    (("docker", "daemon.json", b"{"), "daemon.json: not JSON: "),
    (("containerd", "config.toml", b"[plugins.cri]\nx=1\n"), "config.toml: config version 1"),
])
def test_a_bad_engine_file_is_one_line_and_changes_nothing(
        node: Path, capsys: pytest.CaptureFixture[str], breakage: tuple[str, str, bytes],
        message: str) -> None:
    folder, name, text = breakage
    (node / "etc" / folder / name).write_bytes(text)
    before = snapshot(node)
    assert install(node) == 1
    err = capsys.readouterr().err
    assert err.startswith("cgpu-node: ")
    assert message in err
    assert len(err.splitlines()) == 1
    assert snapshot(node) == before


def test_uninstall_without_an_install(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["uninstall", "--state-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"cgpu-node: nothing to uninstall: no record in {tmp_path}\n"


def test_enforce_reaches_the_wrapper_and_podman_s_hook_and_status_shows_it(
    node: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def status() -> bool:
        capsys.readouterr()
        assert cli.main(["status", "--state-dir", str(node / "state")]) == 0
        shown: bool = json.loads(capsys.readouterr().out)["enforce"]
        return shown

    assert install(node) == 0
    assert not load_settings(node / "etc" / "cgpu_km" / "runtime.toml").enforce
    assert status() is False
    assert install(node, "--enforce") == 0
    assert load_settings(node / "etc" / "cgpu_km" / "runtime.toml").enforce
    hooks = node / "etc" / "containers" / "oci" / "hooks.d"
    documents = sorted(hooks.glob("cgpu-*.json"))
    assert len(documents) == 2
    for path in documents:
        assert "CGPU_ENFORCE=1" in json.loads(path.read_text())["hook"]["env"]
    assert status() is True
    assert uninstall(node) == 0


def test_podman_s_hook_moves_stage_with_its_runtimes(
        node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second install that picks the other start stage leaves one start hook,
    and uninstall still restores every byte."""
    before = snapshot(node / "etc")
    hooks = node / "etc" / "containers" / "oci" / "hooks.d"

    def installed_with(start: str) -> dict[str, list[str]]:
        monkeypatch.setattr(install_mod, "podman_start_stage", lambda: start)
        assert install(node) == 0
        return {path.name: json.loads(path.read_text())["stages"]
                for path in sorted(hooks.glob("cgpu-*.json"))}

    assert installed_with("prestart") == {"cgpu-poststop.json": ["poststop"],
                                          "cgpu-prestart.json": ["prestart"]}
    assert installed_with("createRuntime") == {"cgpu-createRuntime.json": ["createRuntime"],
                                               "cgpu-poststop.json": ["poststop"]}
    assert installed_with("prestart") == {"cgpu-poststop.json": ["poststop"],
                                          "cgpu-prestart.json": ["prestart"]}
    assert uninstall(node) == 0
    assert snapshot(node / "etc") == before
