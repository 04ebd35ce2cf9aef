"""deploy/: manifests validated offline against bundled Kubernetes schemas; the node installer run
for real against a scratch host root."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cgpu_km.deviceplugin.plugin import DEFAULT_KUBELET_SOCKET, parse_args

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
INSTALLER = DEPLOY / "install-node.sh"


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in MANIFESTS:
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in documents() if d["kind"] == kind]


def test_there_are_manifests() -> None:
    kinds = sorted(d["kind"] for d in documents())
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "ServiceAccount"]


@pytest.mark.parametrize("version", ["1.28.0", "1.33.0"])
def test_manifests_validate_strictly(version: str) -> None:
    for doc in documents():
        kubernetes_validate.validate(doc, version, strict=True)


def test_a_misspelt_field_would_be_caught() -> None:
    (daemonset,) = by_kind("DaemonSet")
    broken = json.loads(json.dumps(daemonset))
    broken["spec"]["template"]["spec"]["nodeSelecter"] = {"gpushare": "true"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.33.0", strict=True)


def test_daemonset_selects_gpushare_nodes_and_runs_the_plugin() -> None:
    (daemonset,) = by_kind("DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpushare": "true"}
    (plugin,) = pod["containers"]
    assert plugin["command"] == ["/opt/cgpu_km/venv/bin/cgpu-device-plugin"]
    args = parse_args(plugin["args"])  # the flags exist and their values are accepted
    assert args.kubelet_socket == DEFAULT_KUBELET_SOCKET
    mounts = {m["name"]: m["mountPath"] for m in plugin["volumeMounts"]}
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    assert (
        mounts["device-plugins"]
        == volumes["device-plugins"]
        == str(Path(args.kubelet_socket).parent)
    )
    env = {e["name"] for e in plugin["env"]}
    assert {"NODE_NAME", "NVIDIA_VISIBLE_DEVICES"} <= env
    # The CDI device the plugin hands out is the one the installer describes.
    assert args.cdi_device == "aliyun.com/cgpu=shared"
    assert '"kind": "aliyun.com/cgpu"' in INSTALLER.read_text()


def test_init_container_runs_the_installer_the_image_ships() -> None:
    (daemonset,) = by_kind("DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (install,) = pod["initContainers"]
    script, host_root = install["command"]
    assert script == "/opt/cgpu_km/deploy/install-node.sh"
    assert (
        "deploy/install-node.sh /opt/cgpu_km/deploy/install-node.sh"
        in (DEPLOY / "Dockerfile").read_text()
    )
    mounts = {m["mountPath"]: m["name"] for m in install["volumeMounts"]}
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    assert volumes[mounts[host_root]] == "/"
    assert pod["hostPID"] is True  # nsenter --target 1 reaches the node's systemd


def test_rbac_grants_what_the_plugin_calls() -> None:
    (account,) = by_kind("ServiceAccount")
    (daemonset,) = by_kind("DaemonSet")
    assert (
        daemonset["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    )
    assert daemonset["metadata"]["namespace"] == account["metadata"]["namespace"]
    (role,) = by_kind("ClusterRole")
    (binding,) = by_kind("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "cgpu-km", "namespace": "kube-system"}
    ]
    granted = {
        (res, verb) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]
    }
    assert {("pods", "list"), ("pods", "patch"), ("nodes/status", "patch")} <= granted


# --- the node installer -----------------------------------------------------


@pytest.fixture
def image(tmp_path: Path) -> Path:
    """A stand-in for the image's /opt/cgpu_km."""
    src = tmp_path / "image"
    (src / "venv" / "bin").mkdir(parents=True)
    for program in ("cgpu-hook", "cgpu-daemon", "cgpu-fuse", "cgpu-smi", "cgpu-device-plugin"):
        path = src / "venv" / "bin" / program
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    (src / "systemd").mkdir()
    (src / "systemd" / "cgpu-fuse.service").write_text("[Service]\n")
    (src / "systemd" / "cgpu-daemon.service").write_text("[Service]\n")
    (src / "VERSION").write_text("0.1.0\n")
    return src


def run_installer(
    image: Path, host: Path, tree: Path | None = None, **extra: str
) -> subprocess.CompletedProcess[str]:
    systemctl = host.parent / "systemctl"  # records its arguments, one call a line
    systemctl.write_text(f'#!/bin/sh\necho "$*" >> {host.parent / "systemctl.calls"}\n')
    systemctl.chmod(0o755)
    env = dict(
        os.environ,
        CGPU_SOURCE=str(image),
        SYSTEMCTL=str(systemctl),
        TREE_ROOTS=str(tree) if tree else "/nonexistent",
        **extra,
    )
    return subprocess.run(
        ["sh", str(INSTALLER), str(host)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_installer_installs_files_hooks_and_services(image: Path, tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    result = run_installer(image, host)
    assert result.returncode == 0, result.stderr
    assert (host / "opt/cgpu_km/VERSION").read_text() == "0.1.0\n"
    link = host / "usr/local/bin/cgpu-hook"
    assert os.readlink(link) == "/opt/cgpu_km/venv/bin/cgpu-hook"
    spec = json.loads((host / "etc/cdi/cgpu.json").read_text())
    assert spec["kind"] == "aliyun.com/cgpu"
    assert [d["name"] for d in spec["devices"]] == ["shared"]
    hooks = {h["hookName"]: h for h in spec["containerEdits"]["hooks"]}
    assert hooks["createRuntime"]["args"] == ["cgpu-hook", "createRuntime"]
    assert hooks["poststop"]["args"] == ["cgpu-hook", "poststop"]
    assert list(hooks) == ["createRuntime", "poststop"]
    assert {h["path"] for h in hooks.values()} == {"/usr/local/bin/cgpu-hook"}
    assert (host / "etc/systemd/system/cgpu-daemon.service").is_file()
    calls = (tmp_path / "systemctl.calls").read_text().splitlines()
    assert calls == ["daemon-reload", "enable --now cgpu-daemon.service cgpu-fuse.service"]


def test_installer_hook_stage_for_an_older_runtime(image: Path, tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    result = run_installer(image, host, CGPU_HOOK_STAGE="prestart")
    assert result.returncode == 0, result.stderr
    spec = json.loads((host / "etc/cdi/cgpu.json").read_text())
    assert [(h["hookName"], h["args"][-1]) for h in spec["containerEdits"]["hooks"]] == [
        ("prestart", "prestart"), ("poststop", "poststop")]
    bad = run_installer(image, host, CGPU_HOOK_STAGE="poststart")
    assert bad.returncode == 1
    assert bad.stderr == ("install-node: error: CGPU_HOOK_STAGE=poststart: expected "
                          "createRuntime or prestart\n")


def test_installer_is_idempotent_and_hot_updates_a_new_version(image: Path, tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    tree = Path("/run/cgpu_km")
    upgrade = host / "run/cgpu_km/upgrade"
    upgrade.parent.mkdir(parents=True)
    upgrade.write_text("0\n")
    assert run_installer(image, host, tree).returncode == 0
    marker = host / "opt/cgpu_km/marker"
    marker.write_text("left by the first install")

    again = run_installer(image, host, tree)
    assert "version 0.1.0 already installed" in again.stdout
    assert marker.exists()
    assert upgrade.read_text() == "0\n"

    (image / "VERSION").write_text("0.2.0\n")
    updated = run_installer(image, host, tree)
    assert updated.returncode == 0, updated.stderr
    assert "installing version 0.2.0 (was 0.1.0)" in updated.stdout
    assert not marker.exists()  # the new tree replaced the old one
    assert not (host / "opt/cgpu_km.old").exists()
    assert upgrade.read_text() == "1\n"


def test_installer_refuses_a_source_that_is_not_cgpu_km(image: Path, tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    (image / "VERSION").unlink()
    result = run_installer(image, host)
    assert result.returncode == 1
    assert "VERSION missing: not a cgpu_km image" in result.stderr
    assert list(host.iterdir()) == []
