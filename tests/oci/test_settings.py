"""The wrapper's configuration file: defaults, errors that name the key, round trip."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cgpu_km.container.oci.settings import (
    DEFAULT_RUNTIMES,
    Settings,
    SettingsError,
    load_settings,
    parse_settings,
    render_settings,
)
from cgpu_km.container.oci.spec import HookCall, SimGpu


def test_defaults() -> None:
    settings = parse_settings({})
    assert settings.runtimes == DEFAULT_RUNTIMES == ("nvidia-container-runtime", "runc")
    assert settings.hook.path.endswith("/cgpu-hook")
    assert settings.hook.root is None
    assert settings.simulate == "auto"
    assert settings.simgpu.state == Path("/dev/shm/simgpu-state")


def test_missing_file_means_defaults(tmp_path: Path) -> None:
    assert load_settings(tmp_path / "absent.toml") == parse_settings({})


@pytest.mark.parametrize(("data", "message"), [
    ({"runtime": ["runc"]}, "runtime: unknown key (known: runtimes, hook, simgpu)"),
    ({"runtimes": "runc"}, "runtimes: expected list, got str"),
    ({"runtimes": []}, "runtimes: name at least one runtime"),
    ({"hook": {"timeout": True}}, "hook.timeout: expected int, got bool"),
    ({"hook": {"timeout": 0}}, "hook.timeout: 0 is not above 0"),
    ({"hook": {"env": ["PATH"]}}, "hook.env: expected KEY=VALUE strings"),
    ({"simgpu": {"mode": "yes"}}, "simgpu.mode: 'yes' is none of auto, on, off"),
])
def test_errors_name_the_key(data: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        parse_settings(data)
    assert str(caught.value) == message


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "runtime.toml"
    path.write_text("runtimes = [")
    with pytest.raises(SettingsError, match=f"^{path}: "):
        load_settings(path)


def test_hook_env_on_simgpu() -> None:
    settings = parse_settings({"hook": {"env": ["PATH=/bin", "SIMGPU_STATE=/mine"]},
                               "simgpu": {"folder": "/s", "devices": "Tesla T4:15109MiB"}})
    assert settings.hook_for(False).env == ("PATH=/bin", "SIMGPU_STATE=/mine")
    assert settings.hook_for(True).env == ("PATH=/bin", "SIMGPU_STATE=/mine", "CGPU_SIMULATE=1",
                                           "CGPU_SIMGPU_DIR=/s",
                                           "SIMGPU_DEVICES=Tesla T4:15109MiB")


TEXT = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=12)


@given(st.lists(TEXT, min_size=1, max_size=3), TEXT, st.none() | TEXT,
       st.lists(st.tuples(st.from_regex(r"[A-Z_]{1,6}", fullmatch=True), TEXT).map("=".join),
                max_size=3), st.integers(1, 600), st.sampled_from(["auto", "on", "off"]),
       TEXT, TEXT, st.just("") | TEXT)
def test_render_then_parse_is_the_same(runtimes: list[str], path: str, root: str | None,
                                       env: list[str], timeout: int, mode: str, folder: str,
                                       state: str, devices: str) -> None:
    settings = Settings(tuple(runtimes), HookCall(path, root, tuple(env), timeout), mode,
                        SimGpu(Path(folder), Path(state)), devices)
    parsed = parse_settings(tomllib.loads(render_settings(settings)))
    assert parsed == settings
