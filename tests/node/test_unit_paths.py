"""What the hardened units can execute: an install whose programs or interpreter
lie under /root, /home or /run/user (ProtectHome=yes hides them: the units fail
with 203/EXEC) is refused when the units are to be started, said otherwise;
and the options that choose the prefix's contents (`--wheel`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgpu_km.node import cli, install
from cgpu_km.node.install import InstallError, Layout, Options, check_units_can_run
from cgpu_km.node.prefix import PrefixError, check_wheel, hidden_from_units


@pytest.mark.parametrize(("path", "folder"), [
    ("/root/.venv/bin/python", "/root"), ("/home/op/cgpu/.venv", "/home"), ("/home", "/home"),
    ("/run/user/1000/x", "/run/user"), ("/usr/bin/python3", None), ("/opt/cgpu_km", None),
    ("/homework/x", None), ("/rootfs/x", None),
])
def test_hidden_from_units(path: str, folder: str | None) -> None:
    got = hidden_from_units(Path(path))
    assert (str(got) if got else None) == folder


def test_a_link_into_home_is_hidden(tmp_path: Path) -> None:
    link = tmp_path / "python"
    link.symlink_to("/root/.pyenv/bin/python3")
    assert hidden_from_units(link) == Path("/root")


def test_refused_when_the_units_would_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install, "systemd_running", lambda: True)
    options = Options(python="/root/.pyenv/versions/3.11/bin/python3")
    with pytest.raises(InstallError, match=r"under /root, which the units' ProtectHome=yes"):
        check_units_can_run(Layout(), options, lambda line: None)
    check_units_can_run(Layout(), Options(python="/usr/bin/python3"), lambda line: None)


def test_said_when_the_units_are_not_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install, "systemd_running", lambda: True)
    said: list[str] = []
    check_units_can_run(Layout(prefix=Path("/home/op/cgpu")),
                        Options(python="/usr/bin/python3", services=False), said.append)
    assert said == ["warning: /home/op/cgpu is under /home, which the units' ProtectHome=yes "
                    "hides from the services (they would fail with 203/EXEC)"]


def test_refused_before_anything_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(install, "systemd_running", lambda: True)
    code = cli.main(["install", "--engines", "", "--prefix", "/root/cgpu_km",
                     "--bin-dir", str(tmp_path / "bin"), "--etc", str(tmp_path / "etc"),
                     "--state-dir", str(tmp_path / "state"), "--python", "/usr/bin/python3"])
    assert code == 1
    assert "ProtectHome=yes" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["other-1.0-py3-none-any.whl", "cgpu_km-0.1.0.tar.gz"])
def test_wheel_must_be_a_cgpu_km_wheel(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(PrefixError, match="not a cgpu_km wheel"):
        check_wheel(tmp_path / name)
    with pytest.raises(PrefixError, match="no such file"):
        check_wheel(tmp_path / "cgpu_km-0.1.0-py3-none-any.whl")


def test_wheel_with_no_build_is_refused(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["install", "--no-build", "--wheel", str(tmp_path / "cgpu_km-0.1-py3.whl"),
                     "--state-dir", str(tmp_path / "state")])
    assert code == 1
    assert "--wheel builds the prefix" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
