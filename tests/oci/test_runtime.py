"""cgpu-container-runtime as a program, in front of a stand-in runtime that
records what it was given (its arguments and the config.json it found)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cgpu_km.container.oci.runtime import log_line
from cgpu_km.container.oci.settings import CONFIG_ENV

WRAPPER = Path(sys.executable).parent / "cgpu-container-runtime"
FAKE = """#!/bin/sh
if [ "$1" = features ]; then
    [ -f "{out}/features" ] || exit 1
    cat "{out}/features"
    exit 0
fi
printf '%s\\n' "$@" > "{out}/argv"
[ -f "{bundle}/config.json" ] && cp "{bundle}/config.json" "{out}/seen.json"
exit 7
"""


@pytest.fixture
def setup(tmp_path: Path) -> dict[str, Path]:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    config = {"ociVersion": "1.0.2", "process": {"env": ["PATH=/bin"]},
              "hooks": {"prestart": [{"path": "/usr/bin/dockerd", "args": ["libnetwork"]}]}}
    (bundle / "config.json").write_text(json.dumps(config))
    fake = tmp_path / "fake-runc"
    fake.write_text(FAKE.format(out=tmp_path, bundle=bundle))
    fake.chmod(0o755)
    settings = tmp_path / "runtime.toml"
    settings.write_text(f'runtimes = ["/nonexistent/runc", "{fake}"]\n'
                        '[hook]\npath = "/opt/cgpu_km/bin/cgpu-hook"\n[simgpu]\nmode = "off"\n')
    return {"bundle": bundle, "fake": fake, "settings": settings, "out": tmp_path}


def wrapper(setup: dict[str, Path], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, CONFIG_ENV: str(setup["settings"])}
    return subprocess.run([str(WRAPPER), *args], env=env, capture_output=True, text=True,
                          timeout=60, cwd=setup["out"])


RUNC_1_1 = {"ociVersionMin": "1.0.0", "ociVersionMax": "1.0.2-dev",
            "hooks": ["prestart", "createRuntime", "createContainer", "startContainer",
                      "poststart", "poststop"]}


@pytest.mark.parametrize(("features", "start"), [
    (json.dumps(RUNC_1_1), "createRuntime"),
    (json.dumps({"hooks": ["prestart", "poststart", "poststop"]}), "prestart"),
    (None, "prestart"),  # `features` fails: a runtime older than runc 1.1
    ("no JSON", "prestart"),
])
def test_create_adds_the_hooks_then_runs_the_real_runtime_with_the_same_args(
        setup: dict[str, Path], features: str | None, start: str) -> None:
    if features is not None:
        (setup["out"] / "features").write_text(features)
    args = ["--root", "/r", "--log", str(setup["out"] / "log.json"), "--log-format", "json",
            "create", "--bundle", str(setup["bundle"]), "--pid-file", "/p", "ctr1"]
    result = wrapper(setup, *args)
    assert result.returncode == 7  # the real runtime's status: it was exec'd
    assert (setup["out"] / "argv").read_text().splitlines() == args
    seen = json.loads((setup["out"] / "seen.json").read_text())
    assert seen["hooks"][start] == [
        *([{"path": "/usr/bin/dockerd", "args": ["libnetwork"]}] if start == "prestart" else []),
        {"path": "/opt/cgpu_km/bin/cgpu-hook", "args": ["cgpu-hook", start],
         "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
         "timeout": 30}]
    assert seen["hooks"]["prestart"][0]["path"] == "/usr/bin/dockerd"  # kept, first
    assert seen["hooks"]["poststop"][0]["args"] == ["cgpu-hook", "poststop"]
    assert "mounts" not in seen  # simulation is off


def test_a_hook_already_in_the_config_is_not_run_twice(setup: dict[str, Path]) -> None:
    """A config that has cgpu-hook at prestart (an older wrapper, podman's hooks
    directory) keeps one call, at the stage the runtime's features pick."""
    (setup["out"] / "features").write_text(json.dumps(RUNC_1_1))
    hook = setup["out"] / "bin" / "cgpu-hook"
    hook.parent.mkdir()
    hook.write_text("")
    (setup["out"] / "renamed").symlink_to(hook)  # the same program by another name
    setup["settings"].write_text(setup["settings"].read_text().replace(
        "/opt/cgpu_km/bin/cgpu-hook", str(hook)))
    config = json.loads((setup["bundle"] / "config.json").read_text())
    config["hooks"]["prestart"].append({"path": "/usr/local/bin/cgpu-hook",
                                        "args": ["cgpu-hook", "prestart"]})
    config["hooks"]["createRuntime"] = [{"path": str(setup["out"] / "renamed"),
                                         "args": ["x", "poststop"]}]
    config["hooks"]["poststart"] = [{"path": "/usr/local/bin/cgpu-hook",
                                     "args": ["cgpu-hook", "createRuntime"]}]
    (setup["bundle"] / "config.json").write_text(json.dumps(config))
    assert wrapper(setup, "create", "--bundle", str(setup["bundle"]), "c").returncode == 7
    seen = json.loads((setup["out"] / "seen.json").read_text())
    calls = {stage: [e["args"][-1] for e in entries] for stage, entries in seen["hooks"].items()
             if stage != "prestart"}
    assert [e["path"] for e in seen["hooks"]["prestart"]] == ["/usr/bin/dockerd"]
    assert calls == {"poststart": [], "createRuntime": ["createRuntime"],
                     "poststop": ["poststop"]}


def test_other_commands_pass_through_untouched(setup: dict[str, Path]) -> None:
    before = (setup["bundle"] / "config.json").read_bytes()
    for args in (["--root", "/r", "start", "ctr1"], ["delete", "--force", "ctr1"],
                 ["exec", "--process", str(setup["out"] / "p.json"), "ctr1"], ["--version"]):
        assert wrapper(setup, *args).returncode == 7
        assert (setup["out"] / "argv").read_text().splitlines() == args
    assert (setup["bundle"] / "config.json").read_bytes() == before


def test_errors_go_to_the_runtime_log_and_nothing_runs(setup: dict[str, Path]) -> None:
    setup["settings"].write_text('runtimes = ["/nonexistent/runc"]\n')
    log = setup["out"] / "log.json"
    result = wrapper(setup, "--log", str(log), "--log-format", "json", "create", "--bundle",
                     str(setup["bundle"]), "ctr1")
    assert result.returncode == 1
    assert not (setup["out"] / "argv").exists()
    entry = json.loads(log.read_text())
    assert entry["level"] == "error"
    assert entry["msg"].startswith("cgpu-container-runtime: no OCI runtime found: tried "
                                   "/nonexistent/runc (PATH=")
    assert result.stderr.startswith("cgpu-container-runtime: no OCI runtime found")


def test_a_broken_configuration_fails_create_but_not_delete(setup: dict[str, Path]) -> None:
    setup["settings"].write_text("runtimes = 3\n")
    created = wrapper(setup, "create", "--bundle", str(setup["bundle"]), "ctr1")
    assert created.returncode == 1
    assert created.stderr == (f"cgpu-container-runtime: {setup['settings']}: runtimes: "
                              "expected list, got int\n")
    # delete falls back to the default runtimes; none is here, so it says that.
    deleted = subprocess.run([str(WRAPPER), "delete", "ctr1"], capture_output=True, text=True,
                             env={"PATH": str(setup["fake"].parent),
                                  CONFIG_ENV: str(setup["settings"])}, timeout=60)
    assert "tried nvidia-container-runtime, runc" in deleted.stderr
    (setup["fake"].parent / "runc").symlink_to(setup["fake"])
    deleted = subprocess.run([str(WRAPPER), "delete", "ctr1"], capture_output=True, text=True,
                             env={"PATH": str(setup["fake"].parent),
                                  CONFIG_ENV: str(setup["settings"])}, timeout=60)
    assert deleted.returncode == 7


def test_bad_config_json_is_one_line(setup: dict[str, Path]) -> None:
    (setup["bundle"] / "config.json").write_text("{")
    result = wrapper(setup, "create", "--bundle", str(setup["bundle"]), "ctr1")
    assert result.returncode == 1
    assert result.stderr.startswith(f"cgpu-container-runtime: {setup['bundle']}/config.json "
                                    "is not JSON: ")
    assert len(result.stderr.splitlines()) == 1


def test_log_lines() -> None:
    import datetime

    now = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    assert json.loads(log_line('a "b"', "json", now)) == {
        "level": "error", "msg": 'a "b"', "time": "2026-01-02T03:04:05+00:00"}
    assert log_line('a "b"', "text", now) == \
        'time="2026-01-02T03:04:05+00:00" level=error msg="a \\"b\\""\n'
