"""Device plugin test doubles: a stub kubelet, a fake GPU source, a plugin harness and client."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from cgpu_km.deviceplugin import api_pb2, api_pb2_grpc
from cgpu_km.deviceplugin.allocation import GIB
from cgpu_km.deviceplugin.extender import ExtenderLink
from cgpu_km.deviceplugin.plugin import Config, DevicePlugin

MIB = 1 << 20
T4_MIB = 15109


@dataclass(frozen=True)
class FakeGpu:
    index: int
    uuid: str
    name: str
    memory_total: int


def t4_gpus(count: int = 4) -> list[FakeGpu]:
    return [
        FakeGpu(i, f"GPU-{i:08x}-aaaa-bbbb-cccc-ddddeeeeffff", "Tesla T4", T4_MIB * MIB)
        for i in range(count)
    ]


class FakeSource:
    """A GPU source whose health the test sets."""

    def __init__(self, gpus: Sequence[FakeGpu]) -> None:
        self._gpus = list(gpus)
        self.healthy = {g.uuid: True for g in gpus}
        self.polls = 0

    def gpus(self) -> Sequence[FakeGpu]:
        return self._gpus

    def health(self) -> Mapping[str, bool]:
        self.polls += 1
        return dict(self.healthy)


class _Registration(api_pb2_grpc.RegistrationServicer):
    def __init__(self, requests: queue.Queue[api_pb2.RegisterRequest]) -> None:
        self.requests = requests

    def Register(
        self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> api_pb2.Empty:
        self.requests.put(request)
        return api_pb2.Empty()


class StubKubelet:
    """A real gRPC Registration server on `<dir>/kubelet.sock`, like the kubelet's."""

    def __init__(self, directory: Path) -> None:
        self.socket = directory / "kubelet.sock"
        self.requests: queue.Queue[api_pb2.RegisterRequest] = queue.Queue()
        self._server: grpc.Server | None = None

    def start(self) -> None:
        self.socket.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        # grpcio-tools generates api_pb2_grpc without annotations (as plugin.py notes too).
        api_pb2_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
            _Registration(self.requests), server)
        assert server.add_insecure_port(f"unix://{self.socket}") != 0
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        self.socket.unlink(missing_ok=True)

    def next_registration(self, timeout: float = 10.0) -> api_pb2.RegisterRequest:
        return self.requests.get(timeout=timeout)


@contextmanager
def plugin_channel(socket: Path) -> Iterator[api_pb2_grpc.DevicePluginStub]:
    """A client of the plugin, as the kubelet dials it after registration."""
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        yield api_pb2_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]  # generated


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.02)


class StreamReader:
    """Reads a ListAndWatch stream in a thread so the test can wait for the next update."""

    def __init__(self, stream: Iterator[api_pb2.ListAndWatchResponse]) -> None:
        self.updates: queue.Queue[dict[str, str]] = queue.Queue()
        self._stream = stream
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._stream:
                self.updates.put({d.ID: d.health for d in response.devices})
        except grpc.RpcError:
            pass

    def next(self, timeout: float = 10.0) -> dict[str, str]:
        return self.updates.get(timeout=timeout)


class Harness:
    """A DevicePlugin running in a thread against a stub kubelet, with fast intervals."""

    def __init__(
        self,
        directory: Path,
        source: FakeSource,
        unit_bytes: int = GIB,
        extender: ExtenderLink | None = None,
        cdi_device: str = "",
    ) -> None:
        self.kubelet = StubKubelet(directory)
        self.kubelet.start()
        self.source = source
        config = Config(
            kubelet_socket=self.kubelet.socket,
            unit_bytes=unit_bytes,
            health_interval=0.05,
            watch_interval=0.05,
            cdi_device=cdi_device,
        )
        self.plugin = DevicePlugin(source, config, extender)
        self.socket = config.plugin_socket
        self.uuids = [g.uuid for g in source.gpus()]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.plugin.run, args=(self._stop,), daemon=True)
        self._thread.start()
        # Dialling before the socket exists would cost the client a 1 s reconnect backoff.
        wait_for(self.socket.exists, what="the plugin socket")

    def client(self) -> AbstractContextManager[api_pb2_grpc.DevicePluginStub]:
        return plugin_channel(self.socket)

    def watch(self, stub: api_pb2_grpc.DevicePluginStub) -> StreamReader:
        return StreamReader(stub.ListAndWatch(api_pb2.Empty()))

    def ids(self, gpu: int, units: range | list[int]) -> list[str]:
        """Device IDs of units `units` of GPU `gpu`."""
        return [f"{self.uuids[gpu]}-_-{j}" for j in units]

    wait_for = staticmethod(wait_for)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive(), "plugin did not stop"
        self.kubelet.stop()


class PluginClient:
    """What the kubelet does with a registered plugin: dial its socket, watch its devices."""

    connect = staticmethod(plugin_channel)

    @staticmethod
    def watch(stub: api_pb2_grpc.DevicePluginStub) -> StreamReader:
        return StreamReader(stub.ListAndWatch(api_pb2.Empty()))
