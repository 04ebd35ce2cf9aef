"""A second start of the same container replaces its first registration; a
different container sharing the 12 characters is refused and its poststop
leaves the holder alone (cgpu_km.container.claims), in-process on a FUSE tree."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from cgpu_km.container import claims, hook
from cgpu_km.container.envplan import MIB
from cgpu_km.gpus import GpuInfo
from cgpu_km.tree import client as treefs

GPUS = [GpuInfo(index=i, uuid=f"GPU-{i}000", name="Tesla T4", memory_total=15109 * MIB)
        for i in range(2)]
FIRST = "0123456789abcdef" * 4
SAME_PREFIX = "0123456789ab" + "f" * 52


@pytest.fixture(autouse=True)
def fixed_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(hook, "discover_gpus", lambda: list(GPUS))
    monkeypatch.setenv("CGPU_REGION_DIR", str(tmp_path / "regions"))


def run_hook(monkeypatch: pytest.MonkeyPatch, root: Path, stage: str, bundle: Path,
             container_id: str) -> int:
    state = {"ociVersion": "1.0.2", "id": container_id, "status": "created", "bundle": str(bundle)}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(state)))
    return hook.main(["--root", str(root), stage])


def bundle_with(tmp_path: Path, memory: str) -> Path:
    bundle = tmp_path / f"bundle-{memory}"
    bundle.mkdir()
    config = {"process": {"env": [f"ALIYUN_COM_GPU_MEM_CONTAINER={memory}",
                                  "ALIYUN_COM_GPU_MEM_DEV=15", "NVIDIA_VISIBLE_DEVICES=0"]}}
    (bundle / "config.json").write_text(json.dumps(config))
    return bundle


def memsizes(root: Path) -> dict[str, int]:
    return {name: c.memsize for name, c in treefs.read_tree(root).gpus[0].containers.items()}


def test_decisions() -> None:
    assert claims.decide(None, "a", registered=False) is claims.Claim.NEW
    assert claims.decide(None, "a", registered=True) is claims.Claim.NEW  # the tree says EEXIST
    assert claims.decide("a", "a", registered=True) is claims.Claim.TAKE_OVER
    assert claims.decide("b", "a", registered=True) is claims.Claim.REFUSE
    assert claims.decide("b", "a", registered=False) is claims.Claim.NEW  # a stale record
    assert claims.owns(None, "a")
    assert claims.owns("a", "a")
    assert not claims.owns("b", "a")


@pytest.mark.parametrize(("first", "second"), [
    ("prestart", "prestart"), ("createRuntime", "createRuntime"),
    ("prestart", "createRuntime"),  # started again after the wrapper moved to createRuntime
])
def test_second_start_of_the_same_container_takes_over(
        control_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        claim_dir: Path, first: str, second: str) -> None:
    assert run_hook(monkeypatch, control_tree, first, bundle_with(tmp_path, "6"),
                    FIRST) == 0
    # Started again (poststop never ran), now with another limit: replaced, not refused.
    assert run_hook(monkeypatch, control_tree, second, bundle_with(tmp_path, "8"),
                    FIRST) == 0
    assert memsizes(control_tree) == {FIRST[:12]: 15109 * MIB * 8 // 15}
    assert (claim_dir / FIRST[:12]).read_text() == FIRST + "\n"
    assert run_hook(monkeypatch, control_tree, "poststop", bundle_with(tmp_path, "x"),
                    FIRST) == 0
    assert memsizes(control_tree) == {}
    assert list(claim_dir.iterdir()) == []
    assert run_hook(monkeypatch, control_tree, "poststop", tmp_path / "gone", FIRST) == 0


def test_another_container_with_the_same_12_characters_is_refused(
        control_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert run_hook(monkeypatch, control_tree, "prestart", bundle_with(tmp_path, "6"),
                    FIRST) == 0
    capsys.readouterr()  # (warnings: this state has no pid to inject into)
    bundle = bundle_with(tmp_path, "3")
    assert run_hook(monkeypatch, control_tree, "prestart", bundle, SAME_PREFIX) == 1
    assert capsys.readouterr().err == (
        f"cgpu-hook: container id {FIRST[:12]} is in use by another container ({FIRST}): "
        "the tree knows containers by 12 characters\n")
    # The refused container's poststop (runtimes run it after a failed start) is harmless.
    assert run_hook(monkeypatch, control_tree, "poststop", bundle, SAME_PREFIX) == 0
    assert memsizes(control_tree) == {FIRST[:12]: 15109 * MIB * 6 // 15}
