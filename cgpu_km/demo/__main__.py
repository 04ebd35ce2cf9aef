"""`make demo`: the cGPU documents' Docker commands on this host, on a simulated GPU.

A simulated Tesla T4 (15109 MiB): the control tree served by cgpu-fuse, the
daemon, and a Docker engine of the demo's own (cgpu_km.demo.dockerd) with the
runtime registered by `cgpu-node install --nvidia-name`, so the documents'
`docker run --runtime=nvidia` commands run word for word; only the image
differs (busybox and simgpu's `cuworkload`, which counts the kernels it
completes). It shows gpu_test1 and gpu_test2, `nvidia-smi` inside them,
`cat`/`echo` on their weight, policy 2's throughput ratio measured in the
workloads, cgpu-smi, the eGPU documents' containers (a 5000000000-byte
limit; GPU_UTIL_PER_DEVICE=33), then a host with four GPUs and the
3,4,5,6/23 container. It uses only the user-facing programs and the tree.
Everything is removed at the end: containers, engine, image, tree,
configuration (cgpu-node uninstall).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cgpu_km import paths
from cgpu_km.children import stop_child
from cgpu_km.container.oci.settings import CONFIG_ENV
from cgpu_km.demo.dockerd import DockerError, PrivateDocker
from cgpu_km.demo.image import ImageError, build_rootfs, rootfs_tar

BIN = Path(sys.executable).parent
MIB = 1 << 20
T4 = "Tesla T4:15109MiB:GPU-7e4b0c2a-5d13-4f6e-8a90-3c1d2e4f5a6b"
A10 = ",".join(f"NVIDIA A10:23028MiB:GPU-a10a10a1-0000-4000-8000-00000000000{i}"
               for i in range(4))
KERNEL_US = 2000
REPORT_EVERY = 25
WINDOW_S = 6.0
IMAGE = "cgpu-demo"
WORKLOAD = ["cuworkload", "--alloc", "1GiB", "--stream", "--kernels", "1000000000", "--us",
            str(KERNEL_US), "--report", str(REPORT_EVERY)]
DOC_RUN = "docker run -d -t --runtime=nvidia"


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


@dataclass
class Host:
    """A simulated GPU host: its tree, regions, daemon state and simgpu state."""

    folder: Path
    devices: str
    gpus: int

    @property
    def root(self) -> Path:
        return self.folder / "cgpu_km"

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "CGPU_SIMULATE": "1",
            "CGPU_SIMGPU_DIR": str(paths.simgpu_dir()),
            "CGPU_KM_ROOT": str(self.root),
            "CGPU_REGION_DIR": str(self.folder / "regions"),
            "CGPU_STATE_DIR": str(self.folder / "daemon"),
            "SIMGPU_DEVICES": self.devices,
            "SIMGPU_STATE": str(self.folder / "simgpu-state"),
            "SIMGPU_CONTEXT_MEM": "0",
        }


def wait_for(what: str, ready: Callable[[], object], process: subprocess.Popen[bytes] | None,
             timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if (process is not None and process.poll() is not None) or time.monotonic() > deadline:
            raise SystemExit(f"demo: {what} did not start")
        time.sleep(0.05)


@contextlib.contextmanager
def service(host: Host, name: str, args: list[str], ready: Callable[[], object]) -> Iterator[None]:
    """A background program of the host, stopped with SIGTERM at the end."""
    with (host.folder / f"{name}.log").open("wb") as log:
        process = subprocess.Popen(args, env=host.env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(name, ready, process)
        yield
    finally:
        stop_child(process)


@contextlib.contextmanager
def simulated_host(host: Host) -> Iterator[None]:
    """cgpu-fuse and cgpu-daemon on the host's simulated GPUs."""
    host.root.mkdir(parents=True)
    total = host.devices.split(",")[0].split(":")[1].removesuffix("MiB")
    fuse = [str(BIN / "cgpu-fuse"), "--root", str(host.root), "--gpus", str(host.gpus),
            "--gpu-memory", ",".join([str(int(total) * MIB)] * host.gpus)]
    daemon = [str(BIN / "cgpu-daemon"), "--root", str(host.root), "--period", "0.05"]
    try:
        with service(host, "cgpu-fuse", fuse, lambda: os.path.ismount(host.root)), \
                service(host, "cgpu-daemon", daemon,
                        (host.folder / "daemon" / "snapshot.json").exists):
            yield
    finally:
        if os.path.ismount(host.root):
            subprocess.run(["fusermount", "-u", "-z", str(host.root)], check=False)


class Operator:
    """Runs the commands the way an operator types them, and shows them."""

    def __init__(self, docker: PrivateDocker, host: Host) -> None:
        self.docker = docker
        self.host = host

    def env(self) -> dict[str, str]:
        # The engine's own docker client first (/usr/bin), the project's programs before it.
        path = f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin:{os.environ.get('PATH', '')}"
        return {**self.docker.env, **self.host.env, "PATH": path}

    def shell(self, command: str) -> str:
        """Run it with bash and show it with its output; a failure ends the demo."""
        print(f"$ {command}", flush=True)
        result = subprocess.run(["bash", "-o", "pipefail", "-c", command], env=self.env(),
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        sys.stdout.write(result.stdout)
        sys.stdout.flush()
        if result.returncode != 0:
            raise SystemExit(f"demo: the command above failed (exit status {result.returncode})")
        return result.stdout


def progress(docker: PrivateDocker, name: str) -> tuple[int, float] | None:
    """(kernels completed, the workload's milliseconds), from its last report."""
    for line in reversed(docker.docker("logs", "--tail", "3", name).stdout.splitlines()):
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if line.startswith("kernels=") and "ms" in fields:
            return int(fields["kernels"]), float(fields["ms"])
    return None


def rates(docker: PrivateDocker, names: list[str]) -> dict[str, float]:
    """Kernels per second each workload completed over one window (its own count)."""
    deadline = time.monotonic() + 30
    first = {n: progress(docker, n) for n in names}
    while any(v is None for v in first.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        first = {n: progress(docker, n) for n in names}
    time.sleep(WINDOW_S)
    result = {}
    for name in names:
        start, end = first[name], progress(docker, name)
        if start is None or end is None or end[1] <= start[1]:
            result[name] = 0.0
        else:
            result[name] = (end[0] - start[0]) / ((end[1] - start[1]) / 1000)
    return result


def show_rates(measured: dict[str, float]) -> None:
    full = 1e6 / KERNEL_US
    for name, rate in measured.items():
        print(f"  {name}: {rate:6.1f} kernels/s = {rate / full * 100:5.1f}% of the GPU "
              f"(counted by the workload, {KERNEL_US} us kernels)", flush=True)


def settled_rates(docker: PrivateDocker, names: list[str]) -> dict[str, float]:
    """After a change, let the scheduler settle (2 s), then measure and print the rates."""
    time.sleep(2)
    measured = rates(docker, names)
    show_rates(measured)
    return measured


def show_ratio(measured: dict[str, float], names: tuple[str, str], target: float) -> None:
    first, second = (measured[n] for n in names)
    ratio = first / second if second else float("inf")
    print(f"  throughput ratio {names[0]}/{names[1]} = {ratio:.3f}   target {target:.3f}   "
          f"error {(ratio - target) / target * 100:+.1f}%", flush=True)


def install(op: Operator, etc: Path, state: Path, host: Host) -> None:
    op.shell(f"cgpu-node install --no-build --nvidia-name --engines docker --etc {etc} "
             f"--bin-dir {host.folder.parent / 'bin'} --state-dir {state} "
             f"--docker-pidfile {op.docker.pidfile} --no-services --tree-root {host.root} "
             f"--simulate on --simgpu-state {host.env['SIMGPU_STATE']} "
             f"--simgpu-devices '{host.devices}' --hook-env CGPU_REGION_DIR="
             f"{host.env['CGPU_REGION_DIR']} --hook-env CGPU_HOOK_STATE_DIR="
             f"{host.folder / 'claims'} --hook-env SIMGPU_CONTEXT_MEM=0 "
             f"--prefix {host.folder.parent / 'opt'}")


def one_gpu_part(op: Operator) -> None:
    docker = op.docker
    step("the cGPU document: two containers on the T4, 6/15 and 8/15 of its memory")
    op.shell(f"{DOC_RUN} --name gpu_test1 -v /mnt:/mnt -e ALIYUN_COM_GPU_MEM_CONTAINER=6 "
             f"-e ALIYUN_COM_GPU_MEM_DEV=15 {IMAGE}")
    op.shell(f"{DOC_RUN} --name gpu_test2 -v /mnt:/mnt -e ALIYUN_COM_GPU_MEM_CONTAINER=8 "
             f"-e ALIYUN_COM_GPU_MEM_DEV=15 {IMAGE}")
    wait_for("the workloads", lambda: all(progress(docker, n) for n in ("gpu_test1",
                                                                        "gpu_test2")), None)
    op.shell("docker ps")
    op.shell("docker exec -i gpu_test1 nvidia-smi")
    op.shell("docker exec -i gpu_test2 nvidia-smi --query-gpu=index,name,memory.total,"
             "memory.used --format=csv")
    step("weights through the tree, with $dockerid as docker ps prints it")
    op.shell("dockerid=$(docker ps -q --filter name=gpu_test1); echo $dockerid; "
             "cat $CGPU_KM_ROOT/0/$dockerid/weight; echo 4 > $CGPU_KM_ROOT/0/$dockerid/weight; "
             "cat $CGPU_KM_ROOT/0/$dockerid/weight; cat $CGPU_KM_ROOT/0/free_weight")
    step("policy 2 (weight-based): GPU time follows the weights 4:1")
    op.shell("echo 2 > $CGPU_KM_ROOT/0/policy; cat $CGPU_KM_ROOT/0/policy")
    pair = ("gpu_test1", "gpu_test2")
    show_ratio(settled_rates(docker, list(pair)), pair, 4.0)
    op.shell("cgpu-smi")
    step("live change to policy 1 (preemptive): active containers share 1:1")
    op.shell("echo 1 > $CGPU_KM_ROOT/0/policy; cat $CGPU_KM_ROOT/0/policy")
    show_ratio(settled_rates(docker, list(pair)), pair, 1.0)
    op.shell("docker rm -f gpu_test1 gpu_test2; ls $CGPU_KM_ROOT/0")

    step("the eGPU document: a 5000000000-byte container (minus the 10 MiB reserve)")
    op.shell("docker run -d --name egpu --runtime=nvidia -e NVIDIA_DRIVER_CAPABILITIES=all "
             "-e AMP_VGPU_ENABLE=1 -e GPU_MEM_PER_DEVICE=5000000000 -e NVIDIA_VISIBLE_DEVICES=0 "
             f"-e AMP_USE_HOST_DAEMON=1 {IMAGE}")
    wait_for("egpu", lambda: progress(docker, "egpu"), None)
    op.shell("docker exec egpu nvidia-smi --query-gpu=memory.total --format=csv; "
             "docker logs egpu | head -2; echo expected total=$((5000000000 - 10*1024*1024))")
    op.shell("docker rm -f egpu >/dev/null")
    step("eGPU with GPU_UTIL_PER_DEVICE=33, alone on the GPU: held to a third")
    op.shell("docker run -d --name util33 --runtime=nvidia -e AMP_VGPU_ENABLE=1 "
             f"-e GPU_UTIL_PER_DEVICE=33 -e NVIDIA_VISIBLE_DEVICES=0 {IMAGE}; "
             "cat $CGPU_KM_ROOT/0/$(docker ps -q --filter name=util33)/util_limit")
    wait_for("util33", lambda: progress(docker, "util33"), None)
    settled_rates(docker, ["util33"])
    op.shell("docker rm -f util33 >/dev/null; ls $CGPU_KM_ROOT/0")


def four_gpu_part(op: Operator) -> None:
    step("four NVIDIA A10 (23028 MiB): ALIYUN_COM_GPU_MEM_CONTAINER=3,4,5,6 of "
         "ALIYUN_COM_GPU_MEM_DEV=23")
    op.shell(f"{DOC_RUN} --name gpu_test3 -e ALIYUN_COM_GPU_MEM_CONTAINER=3,4,5,6 "
             f"-e ALIYUN_COM_GPU_MEM_DEV=23 -e NVIDIA_VISIBLE_DEVICES=0,1,2,3 {IMAGE}")
    wait_for("gpu_test3", lambda: progress(op.docker, "gpu_test3"), None)
    op.shell("docker exec gpu_test3 nvidia-smi --query-gpu=index,name,memory.total "
             "--format=csv")
    op.shell("for g in 0 1 2 3; do echo \"GPU $g: $(cat $CGPU_KM_ROOT/$g/*/memsize) bytes\"; "
             "done")
    op.shell("docker rm -f gpu_test3 >/dev/null")


def check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise SystemExit("demo: needs root (docker, FUSE)")
    for program in ("dockerd", "containerd", "runc", "busybox"):
        if shutil.which(program) is None:
            raise SystemExit(f"demo: {program} is missing (make demo installs it)")


def main() -> int:
    check_prerequisites()
    top = Path(tempfile.mkdtemp(prefix="cgpu-demo-"))
    top.chmod(0o755)
    etc, state = top / "etc", top / "node-state"
    (etc / "docker").mkdir(parents=True)
    (etc / "docker" / "daemon.json").write_text("{}\n")
    docker = PrivateDocker(top / "docker", config_file=etc / "docker" / "daemon.json",
                           env={CONFIG_ENV: str(etc / "cgpu_km" / "runtime.toml")})
    try:
        (top / "docker").mkdir()
        (top / "image").mkdir()
        build_rootfs(top / "image" / "rootfs")
        (top / "image.tar").write_bytes(rootfs_tar(top / "image" / "rootfs"))
        t4 = Host(top / "t4", T4, 1)
        t4.folder.mkdir()
        step("a simulated Tesla T4 (15109 MiB): the control tree (cgpu-fuse) and the daemon")
        with simulated_host(t4):
            op = Operator(docker, t4)
            op.shell("ls $CGPU_KM_ROOT; cat $CGPU_KM_ROOT/version $CGPU_KM_ROOT/0/policy")
            step("a Docker engine of the demo's own; cgpu-node registers the runtime, also "
                 "under the name nvidia")
            docker.start()
            install(op, etc, state, t4)
            op.shell("cat $DOCKER_CONFIG_FILE; docker info 2>/dev/null | grep -i runtimes"
                     .replace("$DOCKER_CONFIG_FILE", str(etc / "docker" / "daemon.json")))
            op.shell(f"docker import --change 'ENV PATH=/bin:/usr/bin' --change "
                     f"'CMD {json_list(WORKLOAD)}' {top / 'image.tar'} {IMAGE} | cut -c1-19")
            one_gpu_part(op)
        a10 = Host(top / "a10", A10, 4)
        a10.folder.mkdir()
        step("a host with four GPUs: a new tree, and cgpu-node install again for it")
        with simulated_host(a10):
            op = Operator(docker, a10)
            install(op, etc, state, a10)  # installing again: the new host's tree and simgpu
            four_gpu_part(op)
            step("uninstall: the configuration as it was, byte for byte")
            op.shell(f"cgpu-node uninstall --state-dir {state}; "
                     f"cat {etc / 'docker' / 'daemon.json'}")
            op.shell("docker rmi cgpu-demo >/dev/null; docker ps -a")
    except (DockerError, ImageError) as error:
        raise SystemExit(f"demo: {error}") from None
    finally:
        docker.stop()
        if not os.environ.get("CGPU_DEMO_KEEP"):
            shutil.rmtree(top, ignore_errors=True)
        else:
            print(f"kept {top}")
    step("docker stopped, trees unmounted, everything removed; done")
    return 0


def json_list(words: list[str]) -> str:
    return "[" + ",".join(f'"{word}"' for word in words) + "]"


if __name__ == "__main__":
    sys.exit(main())
