"""Attacker images, volumes, mismatched GPU lists and the enforce mode under a real
dockerd with cgpu-container-runtime (issue 19, items 1, 2, 6, 7; issue 36, items 4, 5).

Each image is built by the test with `docker build` from the test image, one
Dockerfile line (`RUN ln -s ...`) away from it, as a tenant would make it.
The container either starts with libcgpu enforced (an allocation over its
limit fails inside), or `docker run` fails with the hook's one line; a
sentinel folder of the host stays empty and a root-only host file never
shows inside.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpu_km.container.oci.settings import render_settings
from cgpu_km.demo.dockerd import PrivateDocker
from tests.attacks.hostfiles import HostFiles, host_files
from tests.containers.helpers import (
    CGPU_6_OF_15,
    CUDA_OOM,
    IMAGE,
    LIMIT_6_OF_15,
    NOTHING,
    T4,
    UUIDS,
    SimHost,
    missing,
    run_detached,
)

pytestmark = [
    pytest.mark.skipif(missing("dockerd", "containerd", "runc") is not None,
                       reason=f"{missing('dockerd', 'containerd', 'runc')} is not installed "
                              "(apt-get install docker.io)"),
]

LIBRARY = "/usr/local/lib/cgpu/libcgpu.so"
OFF_IMAGE = "a mount that is not the image's own filesystem; libcgpu cannot be enforced"
OVER = ["cuworkload", "--alloc", str(LIMIT_6_OF_15 + (64 << 20))]


@pytest.fixture
def host() -> Iterator[HostFiles]:
    with host_files() as files:
        yield files


def build(docker: PrivateDocker, *lines: str) -> str:
    """An image made from the test image by `lines` of a Dockerfile; its tag."""
    dockerfile = "\n".join([f"FROM {IMAGE}", *lines]) + "\n"
    tag = "cgpu-attack:" + hashlib.sha256(dockerfile.encode()).hexdigest()[:12]
    result = docker.docker("build", "-q", "-t", tag, "-", input=dockerfile, timeout=300)
    assert result.returncode == 0, result.stderr
    return tag


def start(docker: PrivateDocker, image: str, *args: str) -> tuple[int, str]:
    """`docker run -d` with the cGPU variables: its exit status and stderr."""
    result = docker.docker("run", "-d", "--runtime=cgpu", "--network=none", "--name", "attack",
                           *CGPU_6_OF_15, "-e", "NVIDIA_VISIBLE_DEVICES=0", *args, image,
                           "sleep", "600")
    return result.returncode, result.stderr


def hook_line(stderr: str) -> str:
    """The hook's line in docker's error (docker quotes runc's, which quotes the hook's)."""
    found = stderr.split("stderr: cgpu-hook: ", 1)
    assert len(found) == 2, stderr
    return "cgpu-hook: " + found[1].split(": unknown", 1)[0]


@pytest.mark.parametrize("lines", [
    ["RUN ln -s {secret} /etc/ld.so.preload"],
    ["RUN ln -s ../../../../../..{secret} /etc/ld.so.preload"],
    ["RUN ln -s {sentinel} /run/cgpu"],
    ["RUN mkdir -p /usr/local/lib && ln -s {sentinel} /usr/local/lib/cgpu"],
    ["RUN rmdir /usr/bin && ln -s {sentinel} /usr/bin"],  # simgpu's nvidia-smi goes there
    ["RUN ln -s {secret} /usr/bin/nvidia-smi"],
], ids=["preload->host-file", "preload->climb", "run-cgpu->host-folder",
        "library-folder->host-folder", "usr-bin->host-folder", "nvidia-smi->host-file"])
def test_an_image_whose_links_stay_inside_runs_with_its_limit(
        docker: PrivateDocker, sim: SimHost, host: HostFiles, lines: list[str]) -> None:
    image = build(docker, *(line.format(secret=host.secret, sentinel=host.sentinel)
                            for line in lines))
    code, errors = start(docker, image)
    assert code == 0, errors
    over = docker.docker("exec", "attack", *OVER)
    assert f"total={LIMIT_6_OF_15}" in over.stdout, over.stdout + over.stderr
    assert CUDA_OOM in over.stdout, over.stdout
    assert docker.check("exec", "attack", "cat", "/etc/ld.so.preload") == LIBRARY + "\n"
    shown = docker.docker("exec", "attack", "sh", "-c",
                          f"cat {host.secret} 2>&1 | grep -c {host.content.strip()}").stdout
    assert shown == "0\n"
    host.untouched()


@pytest.mark.parametrize(("lines", "message"), [
    (["RUN ln -s ../dev/leak /etc/ld.so.preload"],
     "/etc/ld.so.preload in the image is a link to ../dev/leak, which leads to /dev, "),
    (["RUN ln -s /dev/shm/leak /etc/ld.so.preload"],
     "/etc/ld.so.preload in the image is a link to /dev/shm/leak, which leads to /dev, "),
    (["RUN ln -s /dev/zero /etc/ld.so.preload"],
     "/etc/ld.so.preload in the image is a link to /dev/zero, which leads to /dev, "),
    (["RUN ln -s /proc/self/root/etc /run/cgpu"],
     "/run/cgpu/control in the image is a link to /proc/self/root/etc, which leads to /proc, "),
    (["RUN ln -s /etc/hostname /etc/ld.so.preload"],  # a file docker mounts from the host
     "/etc/ld.so.preload in the image is a mount (at /etc/hostname), not a file of the "
     "image's own filesystem; libcgpu cannot be enforced"),
], ids=["preload->dev", "preload->dev-shm", "preload->dev-zero", "run-cgpu->proc",
        "preload->etc-hostname"])
def test_an_image_whose_links_leave_it_is_refused_with_one_line(
        docker: PrivateDocker, sim: SimHost, host: HostFiles, lines: list[str],
        message: str) -> None:
    image = build(docker, *lines)
    code, errors = start(docker, image)
    assert code != 0
    expected = message if message.endswith("enforced") else message + OFF_IMAGE
    assert hook_line(errors) == f"cgpu-hook: {expected}"
    assert sim.registered() == NOTHING
    assert sim.leftovers() == []
    host.untouched()


@pytest.mark.parametrize(("args", "message"), [
    (["-v", "/run:/run"], "/run/cgpu/control in the image is on /run, "),
    (["-v", "/dev/shm:/run"], "/run/cgpu/control in the image is on /run, "),
], ids=["host-run", "host-dev-shm"])
def test_a_volume_the_host_has_mounted_too_is_refused_with_one_line(
        docker: PrivateDocker, sim: SimHost, args: list[str], message: str) -> None:
    """`docker run -v /run:/run` (issue 36, item 5): the host's own tmpfs is a volume,
    and the hook makes nothing on it."""
    shared = Path(args[-1].split(":")[0])
    before = (shared / "cgpu").exists()
    code, errors = start(docker, IMAGE, *args)
    made = not before and (shared / "cgpu").exists()
    if made:  # what a hook that got this wrong left on the host
        subprocess.run(["rm", "-rf", str(shared / "cgpu")], check=False)
    assert code != 0
    assert hook_line(errors) == f"cgpu-hook: {message}{OFF_IMAGE}"
    assert not made
    assert sim.registered() == NOTHING
    assert sim.leftovers() == []


def test_a_tmpfs_of_the_container_s_own_at_run_takes_the_region(
        docker: PrivateDocker, sim: SimHost) -> None:
    """`--tmpfs /run` is mounted by the runtime for this container alone: it holds the
    region, and the limit holds."""
    code, errors = start(docker, IMAGE, "--tmpfs", "/run")
    assert code == 0, errors
    over = docker.docker("exec", "attack", *OVER)
    assert f"total={LIMIT_6_OF_15}" in over.stdout, over.stdout + over.stderr
    assert CUDA_OOM in over.stdout, over.stdout


def test_an_image_whose_preload_is_one_nul_byte_is_refused_with_one_line(
        docker: PrivateDocker, sim: SimHost) -> None:
    """glibc's loader stops reading at a NUL: libcgpu's line after it would not be read."""
    image = build(docker, "RUN printf '\\000' > /etc/ld.so.preload")
    code, errors = start(docker, image)
    assert code != 0
    assert hook_line(errors) == ("cgpu-hook: /etc/ld.so.preload in the image has a NUL byte "
                                 "at offset 0; libcgpu cannot be enforced")
    assert sim.registered() == NOTHING
    assert sim.leftovers() == []


def test_gpu_lists_that_disagree_are_refused_and_an_unset_nvidia_list_made_to_agree(
        docker: PrivateDocker, sim: SimHost) -> None:
    result = docker.docker("run", "--runtime=cgpu", "--network=none", *CGPU_6_OF_15,
                           "-e", "ALIYUN_COM_GPU_VISIBLE_DEVICES=0",
                           "-e", "NVIDIA_VISIBLE_DEVICES=1", IMAGE, "true")
    assert result.returncode == 125
    assert hook_line(result.stderr) == (
        "cgpu-hook: ALIYUN_COM_GPU_VISIBLE_DEVICES: limits GPU(s) 0 but NVIDIA_VISIBLE_DEVICES "
        "gives the container GPU(s) 1: name the same GPUs in both")
    assert sim.registered() == NOTHING
    dockerid = run_detached(docker, "aliyun", *CGPU_6_OF_15,
                            "-e", "ALIYUN_COM_GPU_VISIBLE_DEVICES=1")
    assert sim.registered() == {0: {}, 1: {dockerid: LIMIT_6_OF_15}}
    # what NVIDIA's runtime reads: the container's config.json, as its init got it
    init_env = docker.check("exec", "aliyun", "sh", "-c", "tr '\\0' '\\n' < /proc/1/environ")
    assert "NVIDIA_VISIBLE_DEVICES=1" in init_env.splitlines()
    assert docker.check("exec", "aliyun", "nvidia-smi", "-L") == \
        f"GPU 0: Tesla T4 (UUID: {UUIDS[1]})\n"


@pytest.fixture
def enforcing(sim: SimHost, runtime_config: Path) -> Iterator[SimHost]:
    """The node in enforce mode (as `cgpu-node install --enforce` writes it), with a
    default_memsize of 2 GiB in the tree."""
    settings = sim.settings()
    hook = dataclasses.replace(settings.hook, env=(*settings.hook.env, "CGPU_ENFORCE=1"))
    runtime_config.write_text(render_settings(dataclasses.replace(settings, hook=hook)))
    (sim.tree / "default_memsize").write_text(f"{2 << 30}\n")
    try:
        yield sim
    finally:
        (sim.tree / "default_memsize").write_text("0\n")
        sim.write_config(runtime_config)


def test_enforce_mode_manages_every_container_given_a_gpu(
        docker: PrivateDocker, enforcing: SimHost) -> None:
    dockerid = run_detached(docker, "plain_gpu", "-e", "NVIDIA_VISIBLE_DEVICES=0",
                            command=["sleep", "600"])
    assert enforcing.registered() == {0: {dockerid: 2 << 30}, 1: {}}
    over = docker.docker("exec", "plain_gpu", "cuworkload", "--alloc", str(3 << 30))
    assert f"total={2 << 30}" in over.stdout, over.stdout + over.stderr
    assert CUDA_OOM in over.stdout
    assert docker.check("exec", "plain_gpu", "cat", "/etc/ld.so.preload") == LIBRARY + "\n"
    # a container given no GPU is left alone
    run_detached(docker, "no_gpu", "-e", "NVIDIA_VISIBLE_DEVICES=none",
                 command=["sleep", "600"])
    assert list(enforcing.registered()[0]) == [dockerid]
    assert docker.docker("exec", "no_gpu", "cat", "/etc/ld.so.preload").returncode != 0


@pytest.mark.parametrize(("env", "message"), [
    (["-e", "CGPU_DISABLE=true"], "CGPU_DISABLE"),
    (["-e", "ALIYUN_COM_GPU_MEM_CONTAINER=0"],
     "ALIYUN_COM_GPU_MEM_CONTAINER: '0' has a 0 element"),
])
def test_enforce_mode_refuses_an_opt_out_with_one_line(
        docker: PrivateDocker, enforcing: SimHost, env: list[str], message: str) -> None:
    result = docker.docker("run", "--runtime=cgpu", "--network=none",
                           "-e", "NVIDIA_VISIBLE_DEVICES=0", *env, IMAGE, "true")
    assert result.returncode == 125
    assert hook_line(result.stderr) == (
        f"cgpu-hook: {message}: this node enforces cGPU (CGPU_ENFORCE): a container given a "
        "GPU cannot opt out")
    assert enforcing.registered() == NOTHING


def test_without_enforce_the_opt_outs_mean_plain_nvidia(
        docker: PrivateDocker, sim: SimHost) -> None:
    for name, env in (("off1", [*CGPU_6_OF_15, "-e", "CGPU_DISABLE=true"]),
                      ("off2", ["-e", "ALIYUN_COM_GPU_MEM_CONTAINER=0"]), ("off3", [])):
        run_detached(docker, name, "-e", "NVIDIA_VISIBLE_DEVICES=0", *env,
                     command=["sleep", "600"])
        assert docker.check("exec", name, "nvidia-smi", "--query-gpu=memory.total",
                            "--format=csv,noheader,nounits") == f"{T4 >> 20}\n"
    assert sim.registered() == NOTHING
