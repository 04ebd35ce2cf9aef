"""`make demo`: the whole system on this host, shown step by step.

On a simulated Tesla T4 (15109 MiB, as in the cGPU documents): the control
tree served by cgpu-fuse, the daemon, and two real runc containers that ask
for 6/15 and 8/15 of the GPU's memory at compute weights 1:2, each running
a simulated workload under libcgpu.  It shows the tree's view, the limits
seen inside the containers, the achieved GPU-time ratio under the weighted
policy, a live policy change, and cleans everything up.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cgpu_km.snapshot import read_snapshot

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SIMGPU = REPO / "simgpu"
LIBCGPU = REPO / "libcgpu" / "libcgpu.so"
WORKLOAD = SIMGPU / "cuworkload"
T4_BYTES = 15109 << 20
T4 = "Tesla T4:15109MiB:GPU-7e4b0c2a-5d13-4f6e-8a90-3c1d2e4f5a6b"
KERNEL_US = 2000
WINDOW_S = 6.0


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def shell(command: str, cwd: Path) -> str:
    """Run one operator command, show it with its output, and return the output."""
    print(f"$ {command}", flush=True)
    result = subprocess.run(
        ["bash", "-c", command], cwd=cwd, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    sys.stdout.write(result.stdout)
    sys.stdout.flush()
    return result.stdout


@dataclass
class Host:
    """Where this demo keeps its simulated host: tree, regions, state."""

    folder: Path

    @property
    def root(self) -> Path:
        return self.folder / "cgpu_km"

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "CGPU_SIMULATE": "1",
            "CGPU_SIMGPU_DIR": str(SIMGPU),
            "CGPU_KM_ROOT": str(self.root),
            "CGPU_REGION_DIR": str(self.folder / "regions"),
            "CGPU_STATE_DIR": str(self.folder / "daemon"),
            "SIMGPU_DEVICES": T4,
            "SIMGPU_STATE": str(self.folder / "simgpu-state"),
            "SIMGPU_CONTEXT_MEM": "0",
        }


def wait_for(
    what: str, ready: Callable[[], object], process: subprocess.Popen[bytes], timeout: float = 20
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"demo: {what} did not start (see the log above)")
        time.sleep(0.05)


@contextlib.contextmanager
def service(host: Host, name: str, args: list[str], ready: Callable[[], object]) -> Iterator[None]:
    """A background program of the host, stopped with SIGTERM at the end."""
    log = (host.folder / f"{name}.log").open("wb")
    process = subprocess.Popen(args, env=host.env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(name, ready, process)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def shared_libraries(binary: Path) -> set[Path]:
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
    return {Path(word) for line in out.splitlines() for word in line.split()[:3]
            if word.startswith("/")}


def make_rootfs(rootfs: Path) -> None:
    """busybox, the workload with the libraries it links, and simgpu's libcuda."""
    for folder in ("bin", "proc", "dev", "sys", "tmp", "etc", "run"):
        (rootfs / folder).mkdir(parents=True, exist_ok=True)
    busybox = shutil.which("busybox")
    if busybox is None:
        raise SystemExit("demo: busybox is missing (apt-get install busybox-static)")
    shutil.copy2(busybox, rootfs / "bin" / "busybox")
    for applet in ("sh", "cat", "sleep"):
        (rootfs / "bin" / applet).symlink_to("busybox")
    shutil.copy2(WORKLOAD, rootfs / "bin" / "cuworkload")
    libraries = shared_libraries(WORKLOAD) | shared_libraries(LIBCGPU)
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        libraries |= shared_libraries(SIMGPU / name)
    for library in libraries:
        if SIMGPU in library.parents:
            continue
        target = rootfs / str(library).lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(library.resolve(), target)
    gpu_libraries = rootfs / "usr" / "lib" / "x86_64-linux-gnu"
    gpu_libraries.mkdir(parents=True, exist_ok=True)
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        shutil.copy2(SIMGPU / name, gpu_libraries / name)


def make_bundle(host: Host, name: str, rootfs: Path, env: dict[str, str]) -> Path:
    """An OCI bundle whose prestart/poststop hooks are cgpu-hook."""
    bundle = host.folder / f"bundle-{name}"
    bundle.mkdir()
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True)
    config = json.loads((bundle / "config.json").read_text())
    config["root"] = {"path": str(rootfs), "readonly": False}
    config["process"]["terminal"] = False
    command = (f"cuworkload --alloc 1GiB --kernels 1000000 --us {KERNEL_US} --hold 600")
    config["process"]["args"] = ["/bin/sh", "-c", command]
    config["process"]["env"] = [
        "PATH=/bin", "LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu", "NVIDIA_VISIBLE_DEVICES=0",
        f"SIMGPU_DEVICES={T4}", "SIMGPU_STATE=/simgpu-state", "SIMGPU_CONTEXT_MEM=0",
        *(f"{key}={value}" for key, value in env.items()),
    ]
    config["mounts"].append({"destination": "/simgpu-state", "type": "bind",
                             "source": host.env["SIMGPU_STATE"], "options": ["bind", "rw"]})
    hook_env = [f"{key}={host.env[key]}" for key in (
        "PATH", "CGPU_SIMULATE", "CGPU_SIMGPU_DIR", "CGPU_REGION_DIR", "SIMGPU_DEVICES",
        "SIMGPU_STATE", "SIMGPU_CONTEXT_MEM")]
    config["hooks"] = {
        stage: [{"path": str(BIN / "cgpu-hook"),
                 "args": ["cgpu-hook", "--root", str(host.root), stage],
                 "env": hook_env, "timeout": 60}]
        for stage in ("prestart", "poststop")
    }
    (bundle / "config.json").write_text(json.dumps(config, indent=1))
    return bundle


def container_ready(log: Path) -> Callable[[], bool]:
    """True once the workload in the container has printed its `ready` line."""
    return lambda: "ready pid=" in log.read_text(errors="replace")


@contextlib.contextmanager
def containers(host: Host, specs: dict[str, dict[str, str]]) -> Iterator[list[str]]:
    """Run one runc container per spec (name -> environment) for the block."""
    rootfs = host.folder / "rootfs"
    make_rootfs(rootfs)
    running: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, env in specs.items():
            bundle = make_bundle(host, name, rootfs, env)
            log = (host.folder / f"{name}.log").open("wb")
            running[name] = subprocess.Popen(
                ["runc", "run", "--bundle", str(bundle), name], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT)
            log.close()
        for name, process in running.items():
            wait_for(f"container {name}", container_ready(host.folder / f"{name}.log"), process)
        yield list(running)
    finally:
        for name, process in running.items():
            subprocess.run(["runc", "kill", name, "KILL"], capture_output=True)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=15)
            subprocess.run(["runc", "delete", "--force", name], capture_output=True)


def gpu_seconds(host: Host) -> dict[str, float]:
    snapshot = read_snapshot(host.folder / "daemon" / "snapshot.json")
    if snapshot is None:
        raise SystemExit("demo: the daemon published no snapshot")
    return {c.name: c.gpu_time_seconds for c in snapshot.containers}


def measure(host: Host, names: list[str]) -> dict[str, float]:
    """GPU seconds each container got per second of wall time, over one window."""
    before, start = gpu_seconds(host), time.monotonic()
    time.sleep(WINDOW_S)
    after, elapsed = gpu_seconds(host), time.monotonic() - start
    return {n: (after.get(n, 0.0) - before.get(n, 0.0)) / elapsed for n in names}


def show_ratio(shares: dict[str, float], names: list[str], target: float) -> None:
    first, second = (shares[n] for n in names)
    ratio = second / first if first else float("inf")
    for name in names:
        print(f"  {name}: {shares[name] * 100:5.1f}% of the GPU "
              f"({shares[name] * 1e6 / KERNEL_US:6.1f} kernels/s)")
    print(f"  throughput ratio {names[1]}/{names[0]} = {ratio:.3f}   target {target:.3f}   "
          f"error {abs(ratio - target) / target * 100:.1f}%", flush=True)


def check_prerequisites() -> None:
    missing = [str(p.relative_to(REPO)) for p in (WORKLOAD, LIBCGPU, SIMGPU / "libcuda.so.1")
               if not p.exists()]
    if missing:
        raise SystemExit(f"demo: not built: {', '.join(missing)} (run make build)")
    if os.geteuid() != 0 or shutil.which("runc") is None:
        raise SystemExit("demo: needs root and runc (make demo installs runc)")


def main() -> int:
    check_prerequisites()
    host = Host(Path(tempfile.mkdtemp(prefix="cgpu-demo-")))
    host.folder.chmod(0o755)
    host.root.mkdir()
    fuse = [str(BIN / "cgpu-fuse"), "--root", str(host.root), "--gpus", "1",
            "--gpu-memory", str(T4_BYTES)]
    daemon = [str(BIN / "cgpu-daemon"), "--root", str(host.root), "--period", "0.05"]
    snapshot = host.folder / "daemon" / "snapshot.json"
    specs = {
        "web-6g": {"ALIYUN_COM_GPU_MEM_CONTAINER": "6", "ALIYUN_COM_GPU_MEM_DEV": "15",
                   "ALIYUN_COM_GPU_SCHD_WEIGHT": "1"},
        "train-8g": {"ALIYUN_COM_GPU_MEM_CONTAINER": "8", "ALIYUN_COM_GPU_MEM_DEV": "15",
                     "ALIYUN_COM_GPU_SCHD_WEIGHT": "2"},
    }
    try:
        step("a simulated Tesla T4 (15109 MiB); the control tree served by cgpu-fuse")
        with service(host, "cgpu-fuse", fuse, lambda: os.path.ismount(host.root)):
            shell("ls -l", host.root)
            shell("cat version 0/policy 0/max_inst 0/free_weight", host.root)
            step("the daemon (trio) attaches to the tree and the GPU")
            with service(host, "cgpu-daemon", daemon, snapshot.exists):
                step("two runc containers: ALIYUN_COM_GPU_MEM_CONTAINER=6 and =8 of "
                     "ALIYUN_COM_GPU_MEM_DEV=15, weights 1:2")
                with containers(host, specs) as names:
                    for name in names:
                        print(f"{name} sees: " + (host.folder / f"{name}.log").read_text()
                              .splitlines()[-1], flush=True)
                    time.sleep(1)  # one meminfo feed from the daemon
                    shell("ls 0; cat 0/free_weight", host.root)
                    shell("for c in web-6g train-8g; do echo \"$c: memsize=$(cat 0/$c/memsize)"
                          " weight=$(cat 0/$c/weight)\"; cat 0/$c/meminfo; done", host.root)
                    step("policy 2 (weight-based): GPU time follows the weights 1:2")
                    shell("echo 2 > 0/policy; cat 0/policy", host.root)
                    time.sleep(2)
                    show_ratio(measure(host, names), names, 2.0)
                    subprocess.run([str(BIN / "cgpu-smi"), "--root", str(host.root)],
                                   env=host.env, check=False)
                    step("live change to policy 1 (preemptive): active containers share 1:1")
                    shell("echo 1 > 0/policy; cat 0/policy", host.root)
                    time.sleep(2)
                    show_ratio(measure(host, names), names, 1.0)
                step("containers stopped: the poststop hook removed them from the tree")
                shell("ls 0; cat 0/free_weight", host.root)
        step("daemon stopped, tree unmounted; done")
    finally:
        with contextlib.suppress(OSError):
            if os.path.ismount(host.root):
                subprocess.run(["fusermount", "-u", "-z", str(host.root)], check=False)
        if os.environ.get("CGPU_DEMO_KEEP"):
            print(f"kept {host.folder}")
        else:
            shutil.rmtree(host.folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
