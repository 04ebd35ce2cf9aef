"""`cgpu-device-plugin`: the kubelet device plugin for `aliyun.com/gpu-mem` (gpushare-compatible).

It serves the v1beta1 DevicePlugin API on a unix socket in the kubelet's
device-plugin directory, registers that socket with the kubelet, streams every
memory unit of every GPU with its health, packs each container's units onto one
GPU, and answers Allocate with the variables the cgpu OCI hook turns into limits.
When the kubelet restarts (it recreates kubelet.sock and deletes plugin sockets)
the plugin serves its socket again and registers again. SIGTERM stops it cleanly.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import NoReturn, TypeVar

import grpc

from cgpu_km.deviceplugin import api_pb2, api_pb2_grpc
from cgpu_km.deviceplugin.allocation import UNIT_BYTES, AllocationError, Inventory
from cgpu_km.deviceplugin.extender import AssumedPod, ExtenderLink, KubeClient, KubeError
from cgpu_km.deviceplugin.source import GpuSource, NvmlGpuSource
from cgpu_km.gpus import GpuError

log = logging.getLogger("cgpu-device-plugin")
T = TypeVar("T")

API_VERSION = "v1beta1"
RESOURCE_NAME = "aliyun.com/gpu-mem"
DEFAULT_KUBELET_SOCKET = "/var/lib/kubelet/device-plugins/kubelet.sock"
DEFAULT_ENDPOINT = "aliyungpushare.sock"  # the socket name gpushare uses
# The kubelet's gRPC client keeps grpc-go's default receive limit: a device list
# (one ListAndWatch message) above it never reaches the kubelet.
KUBELET_MAX_MESSAGE = 4 * 1024 * 1024
CDI_NAME = re.compile(r"[a-z0-9][a-z0-9.-]*/[a-zA-Z0-9][a-zA-Z0-9_.-]*=[a-zA-Z0-9][a-zA-Z0-9_.:-]*")


class DeviceState:
    """Device health shared between the health poller and the ListAndWatch streams."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self._cond = threading.Condition()
        self._health: dict[str, bool] = {g.uuid: True for g in inventory.gpus}
        self._generation = 0
        self._closed = False

    def set_health(self, health: Mapping[str, bool]) -> bool:
        """Record the GPUs' health; True (and wake the streams) when it changed."""
        new = {g.uuid: bool(health.get(g.uuid, False)) for g in self.inventory.gpus}
        with self._cond:
            if new == self._health:
                return False
            for uuid, ok in new.items():
                if ok != self._health[uuid]:
                    log.warning("GPU %s is now %s", uuid, "healthy" if ok else "unhealthy")
            self._health = new
            self._generation += 1
            self._cond.notify_all()
            return True

    def snapshot(self) -> tuple[int, api_pb2.ListAndWatchResponse]:
        with self._cond:
            generation, health = self._generation, dict(self._health)
        devices = [
            api_pb2.Device(ID=dev_id, health=status)
            for dev_id, status in self.inventory.devices_by_health(health)
        ]
        return generation, api_pb2.ListAndWatchResponse(devices=devices)

    def wait_change(self, seen: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._generation != seen or self._closed, timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def reopen(self) -> None:
        with self._cond:
            self._closed = False


class DevicePluginServicer(api_pb2_grpc.DevicePluginServicer):
    """The gRPC handlers; every decision is made by the pure Inventory (and, with the
    scheduler extender, by the pod it placed)."""

    def __init__(
        self, state: DeviceState, extender: ExtenderLink | None = None, cdi_device: str = ""
    ) -> None:
        self.state = state
        self.extender = extender
        self.cdi_devices = [api_pb2.CDIDevice(name=cdi_device)] if cdi_device else []
        self._allocating = threading.Lock()  # two Allocates must not claim the same pod

    def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return plugin_options()

    def ListAndWatch(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> Iterator[api_pb2.ListAndWatchResponse]:
        seen = -1
        while context.is_active() and not self.state.closed:
            generation, response = self.state.snapshot()
            if generation != seen:
                seen = generation
                yield response
            self.state.wait_change(seen, timeout=1.0)

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        responses = []
        for req in request.container_requests:
            decide = functools.partial(
                self.state.inventory.preferred,
                list(req.available_deviceIDs),
                list(req.must_include_deviceIDs),
                req.allocation_size,
            )
            ids = self._answer(context, decide)
            responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    def Allocate(
        self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext
    ) -> api_pb2.AllocateResponse:
        requests = [list(r.devices_ids) for r in request.container_requests]
        with self._allocating:
            pod = self._extender_pod(context, sum(len(r) for r in requests))
            index = None if pod is None else pod.gpu_index
            envs = self._answer(context, lambda: self.state.inventory.allocate(requests, index))
            if pod is not None and self.extender is not None:
                try:
                    self.extender.mark_assigned(pod)
                except KubeError as err:
                    self._abort(context, AllocationError("UNAVAILABLE", str(err)))
                log.info(
                    "pod %s/%s: GPU %d, as the scheduler extender chose",
                    pod.namespace,
                    pod.name,
                    pod.gpu_index,
                )
        for env in envs:
            log.info(
                "allocated %s units on GPU %s (%s)",
                env["ALIYUN_COM_GPU_MEM_CONTAINER"],
                env["ALIYUN_COM_GPU_MEM_IDX"],
                env["NVIDIA_VISIBLE_DEVICES"],
            )
        return api_pb2.AllocateResponse(
            container_responses=[
                api_pb2.ContainerAllocateResponse(envs=env, cdi_devices=self.cdi_devices)
                for env in envs
            ]
        )

    def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()

    def _extender_pod(self, context: grpc.ServicerContext, units: int) -> AssumedPod | None:
        if self.extender is None:
            return None
        try:
            pod = self.extender.find(units)
        except KubeError as err:
            self._abort(
                context,
                AllocationError(
                    "UNAVAILABLE", f"cannot ask the API server which GPU the scheduler chose: {err}"
                ),
            )
        if pod is None:
            log.info(
                "no pod assumed by the scheduler extender with %d units: placing by device IDs",
                units,
            )
        return pod

    @staticmethod
    def _abort(context: grpc.ServicerContext, err: AllocationError) -> NoReturn:
        log.warning("refused: %s", err.message)
        context.abort(getattr(grpc.StatusCode, err.code), err.message)
        raise err  # not reached: abort raises

    @classmethod
    def _answer(cls, context: grpc.ServicerContext, decide: Callable[[], T]) -> T:
        """decide(), or abort the RPC with the refusal's status code and message."""
        try:
            return decide()
        except AllocationError as err:
            cls._abort(context, err)


def plugin_options() -> api_pb2.DevicePluginOptions:
    return api_pb2.DevicePluginOptions(
        pre_start_required=False, get_preferred_allocation_available=True
    )


@dataclass(frozen=True)
class Config:
    kubelet_socket: Path
    endpoint: str = DEFAULT_ENDPOINT
    resource_name: str = RESOURCE_NAME
    unit_bytes: int = UNIT_BYTES["GiB"]
    health_interval: float = 10.0
    watch_interval: float = 1.0
    cdi_device: str = ""

    @property
    def plugin_socket(self) -> Path:
        return self.kubelet_socket.parent / self.endpoint


def _socket_key(path: Path) -> tuple[int, int, int] | None:
    """Identity of a socket file: a recreated socket has a new inode or times."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


class DevicePlugin:
    """Serves the socket, registers with the kubelet, polls health; `run` until `stop`."""

    publish_retry = 30.0  # seconds between attempts to publish aliyun.com/gpu-count

    def __init__(
        self, source: GpuSource, config: Config, extender: ExtenderLink | None = None
    ) -> None:
        self.config = config
        self.source = source
        self.extender = extender
        self._gpu_count_published = extender is None
        self._next_publish = 0.0
        self.state = DeviceState(Inventory(source.gpus(), config.unit_bytes))
        size = self.state.snapshot()[1].ByteSize()
        if size > KUBELET_MAX_MESSAGE:
            raise ValueError(
                f"{len(self.state.inventory.device_ids())} devices make a {size}-byte device "
                f"list, above the kubelet's {KUBELET_MAX_MESSAGE}-byte message limit: "
                "use a larger --memory-unit"
            )
        self._server: grpc.Server | None = None
        self._serving_key: tuple[int, int, int] | None = None
        self._registered_with: tuple[int, int, int] | None = None
        self._last_error = ""
        self.registrations = 0

    # -- serving ---------------------------------------------------------
    def serve(self) -> None:
        """(Re)start the gRPC server on the plugin socket."""
        self.stop_serving()
        path = self.config.plugin_socket
        path.unlink(missing_ok=True)
        self.state.reopen()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="dp"))
        api_pb2_grpc.add_DevicePluginServicer_to_server(  # type: ignore[no-untyped-call]
            DevicePluginServicer(self.state, self.extender, self.config.cdi_device), server
        )
        if server.add_insecure_port(f"unix://{path}") == 0:
            raise OSError(f"cannot listen on {path}")
        server.start()
        self._server = server
        self._serving_key = _socket_key(path)
        log.info("serving %s on %s", self.config.resource_name, path)

    def stop_serving(self) -> None:
        if self._server is None:
            return
        self.state.close()  # ends the ListAndWatch streams
        self._server.stop(grace=1.0).wait()
        self._server = None
        self.config.plugin_socket.unlink(missing_ok=True)

    # -- registration ----------------------------------------------------
    def register(self) -> None:
        request = api_pb2.RegisterRequest(
            version=API_VERSION,
            endpoint=self.config.endpoint,
            resource_name=self.config.resource_name,
            options=plugin_options(),
        )
        with grpc.insecure_channel(f"unix://{self.config.kubelet_socket}") as channel:
            stub = api_pb2_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
            stub.Register(request, timeout=5.0)
        self.registrations += 1
        log.info(
            "registered %s with the kubelet at %s",
            self.config.resource_name,
            self.config.kubelet_socket,
        )

    def tick(self) -> None:
        """One watch step: serve again if our socket vanished, register again if the
        kubelet's socket is new."""
        own_key = _socket_key(self.config.plugin_socket)
        own_ok = self._server is not None and own_key == self._serving_key
        kubelet = _socket_key(self.config.kubelet_socket)
        kubelet_new = kubelet is not None and kubelet != self._registered_with
        if not own_ok or (kubelet_new and self._registered_with is not None):
            if self._server is not None:
                log.info("kubelet restarted or plugin socket removed: serving again")
            self.serve()
            self._registered_with = None
            kubelet_new = kubelet is not None
        if kubelet_new:
            try:
                self.register()
            except grpc.RpcError as err:
                message = f"registration with {self.config.kubelet_socket} failed: {err.details()}"
                if message != self._last_error:
                    log.warning("%s (will retry)", message)
                self._last_error = message
                return
            self._last_error = ""
            self._registered_with = kubelet
            self._gpu_count_published = self.extender is None
        self._publish_gpu_count()

    def _publish_gpu_count(self) -> None:
        """Tell the scheduler extender how many GPUs this node has (after each registration,
        retried every PUBLISH_RETRY seconds until it works)."""
        if self._gpu_count_published or self.extender is None:
            return
        now = time.monotonic()
        if now < self._next_publish:
            return
        count = len(self.state.inventory.gpus)
        try:
            self.extender.publish_gpu_count(count)
        except KubeError as err:
            log.warning("publishing aliyun.com/gpu-count failed (will retry): %s", err)
            self._next_publish = now + self.publish_retry
            return
        self._gpu_count_published = True
        log.info("node %s: aliyun.com/gpu-count=%d", self.extender.node, count)

    def poll_health(self) -> None:
        self.state.set_health(self.source.health())

    def run(self, stop: threading.Event) -> None:
        next_health = 0.0
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now >= next_health:
                    self.poll_health()
                    next_health = now + self.config.health_interval
                self.tick()
                stop.wait(self.config.watch_interval)
        finally:
            self.stop_serving()
            log.info("stopped")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="cgpu-device-plugin",
        description="Kubelet device plugin offering GPU memory as aliyun.com/gpu-mem units "
        "(compatible with Alibaba gpushare).",
    )
    parser.add_argument(
        "--kubelet-socket",
        default=DEFAULT_KUBELET_SOCKET,
        help="the kubelet's registration socket; the plugin serves its own "
        "socket in the same directory (default: %(default)s)",
    )
    parser.add_argument(
        "--endpoint",
        default=DEFAULT_ENDPOINT,
        help="file name of the plugin's socket (default: %(default)s)",
    )
    parser.add_argument(
        "--memory-unit",
        choices=sorted(UNIT_BYTES),
        default="GiB",
        help="one device per this much GPU memory (default: %(default)s)",
    )
    parser.add_argument(
        "--resource-name",
        default=RESOURCE_NAME,
        help="extended resource name (default: %(default)s)",
    )
    parser.add_argument(
        "--health-interval",
        type=float,
        default=10.0,
        help="seconds between NVML health polls (default: %(default)s)",
    )
    parser.add_argument(
        "--watch-interval",
        type=float,
        default=1.0,
        help="seconds between checks of the kubelet socket (default: %(default)s)",
    )
    parser.add_argument(
        "--cdi-device",
        default="",
        metavar="VENDOR/CLASS=NAME",
        help="CDI device to add to every allocated container, e.g. aliyun.com/cgpu=shared "
        "whose CDI spec runs cgpu-hook (kubelet 1.28+; default: none)",
    )
    parser.add_argument(
        "--scheduler-extender",
        choices=["auto", "on", "off"],
        default="auto",
        help="follow the GPU chosen by gpushare's scheduler extender (pod annotations) and "
        "publish aliyun.com/gpu-count; auto: when running in a pod with a node name "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME", ""),
        help="this node's name, for the scheduler extender (default: $NODE_NAME)",
    )
    args = parser.parse_args(argv)
    if "/" in args.endpoint or not args.endpoint:
        parser.error(f"--endpoint must be a plain file name, got {args.endpoint!r}")
    if args.cdi_device and not CDI_NAME.fullmatch(args.cdi_device):
        parser.error(f"--cdi-device must look like vendor.com/class=name, got {args.cdi_device!r}")
    for name in ("health_interval", "watch_interval"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def extender_link(
    mode: str,
    node: str,
    resource: str,
    make_client: Callable[[], KubeClient] = KubeClient.in_cluster,
) -> ExtenderLink | None:
    """The link to gpushare's scheduler extender for `--scheduler-extender` mode; KubeError
    when mode is `on` and the plugin cannot reach the API server as a pod."""
    if mode == "off":
        return None
    try:
        if not node:
            raise KubeError("no node name: set --node-name or NODE_NAME")
        client = make_client()
    except KubeError as err:
        if mode == "on":
            raise
        log.info("scheduler extender support off: %s", err)
        return None
    log.info("following gpushare's scheduler extender for pods on node %s", node)
    return ExtenderLink(client, node, resource)


def _fail(message: object, code: int) -> int:
    print(f"cgpu-device-plugin: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None, source: GpuSource | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(levelname)s: %(message)s")
    config = Config(
        kubelet_socket=Path(args.kubelet_socket),
        endpoint=args.endpoint,
        resource_name=args.resource_name,
        unit_bytes=UNIT_BYTES[args.memory_unit],
        health_interval=args.health_interval,
        watch_interval=args.watch_interval,
        cdi_device=args.cdi_device,
    )
    if not config.kubelet_socket.parent.is_dir():
        return _fail(f"{config.kubelet_socket.parent} is not a directory", 2)
    try:
        extender = extender_link(args.scheduler_extender, args.node_name, args.resource_name)
    except KubeError as err:
        return _fail(f"--scheduler-extender=on: {err}", 2)
    if source is None:
        try:
            source = NvmlGpuSource()
        except GpuError as err:
            return _fail(err, 1)
    if not source.gpus():
        return _fail("no GPUs found on this node", 1)
    try:
        plugin = DevicePlugin(source, config, extender)
    except ValueError as err:
        return _fail(err, 2)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for gpu in plugin.state.inventory.gpus:
        log.info("GPU %d %s: %d devices of 1 %s", gpu.index, gpu.uuid, gpu.units, args.memory_unit)
    try:
        plugin.run(stop)
    except OSError as err:
        return _fail(err, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
