"""The device plugin over real gRPC: a stub kubelet on a unix socket, the plugin's own socket."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from cgpu_km.deviceplugin import api_pb2
from cgpu_km.deviceplugin.allocation import MIB
from cgpu_km.deviceplugin.plugin import KUBELET_MAX_MESSAGE, Config, DevicePlugin, main
from tests.deviceplugin.doubles import FakeSource, Harness


def preferred(
    available: list[str], size: int, must: list[str] | None = None
) -> api_pb2.PreferredAllocationRequest:
    return api_pb2.PreferredAllocationRequest(
        container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=available,
                must_include_deviceIDs=must or [],
                allocation_size=size,
            )
        ]
    )


def allocate(*containers: list[str]) -> api_pb2.AllocateRequest:
    return api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=c) for c in containers]
    )


def test_registers_resource_name_endpoint_and_options(harness: Harness) -> None:
    reg = harness.kubelet.next_registration()
    assert reg.version == "v1beta1"
    assert reg.resource_name == "aliyun.com/gpu-mem"
    assert reg.endpoint == "aliyungpushare.sock"
    assert harness.socket.name == reg.endpoint
    assert reg.options.get_preferred_allocation_available
    assert not reg.options.pre_start_required
    with harness.client() as stub:
        options = stub.GetDevicePluginOptions(api_pb2.Empty())
    assert options.get_preferred_allocation_available
    assert not options.pre_start_required


def test_list_and_watch_streams_units_and_follows_health(
    harness: Harness, fake_source: FakeSource
) -> None:
    U, ids = harness.uuids, harness.ids
    with harness.client() as stub:
        stream = harness.watch(stub)
        first = stream.next()
        assert len(first) == 4 * 15
        assert set(first) == {f"{u}-_-{j}" for u in U for j in range(15)}
        assert set(first.values()) == {"Healthy"}

        fake_source.healthy[U[1]] = False
        sick = stream.next()
        assert {d for d, h in sick.items() if h == "Unhealthy"} == set(ids(1, range(15)))

        fake_source.healthy[U[1]] = True
        assert set(stream.next().values()) == {"Healthy"}

        del fake_source.healthy[U[3]]  # the GPU disappeared
        gone = stream.next()
        assert {d for d, h in gone.items() if h == "Unhealthy"} == set(ids(3, range(15)))


def test_preferred_allocation_fits_and_packs(harness: Harness) -> None:
    ids = harness.ids
    everything = [d for g in range(4) for d in ids(g, range(15))]
    # GPU0 has 4 units free, GPU1 7, GPU2 and GPU3 all 15.
    partly_used = (
        ids(0, range(11, 15)) + ids(1, range(8, 15)) + ids(2, range(15)) + ids(3, range(15))
    )
    with harness.client() as stub:
        fits = stub.GetPreferredAllocation(preferred(everything, 6))
        assert list(fits.container_responses[0].deviceIDs) == ids(0, range(6))
        packed = stub.GetPreferredAllocation(preferred(partly_used, 6))
        assert list(packed.container_responses[0].deviceIDs) == ids(1, range(8, 14))
        small = stub.GetPreferredAllocation(preferred(partly_used, 4))
        assert list(small.container_responses[0].deviceIDs) == ids(0, range(11, 15))


def test_preferred_allocation_errors_are_clear(harness: Harness) -> None:
    ids = harness.ids
    scattered = ids(0, range(5)) + ids(1, range(5)) + ids(2, range(5)) + ids(3, range(5))
    with harness.client() as stub:
        with pytest.raises(grpc.RpcError) as err:
            stub.GetPreferredAllocation(preferred(scattered, 6))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "6 units of GiB do not fit on any one GPU" in err.value.details()

        with pytest.raises(grpc.RpcError) as err:
            stub.GetPreferredAllocation(preferred(scattered, 2, must=ids(0, [0]) + ids(2, [0])))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "must_include spans GPUs 0" in err.value.details()


def test_allocate_returns_the_hook_environment(harness: Harness) -> None:
    U, ids = harness.uuids, harness.ids
    with harness.client() as stub:
        response = stub.Allocate(allocate(ids(2, range(6))))
    (container,) = response.container_responses
    assert dict(container.envs) == {
        "NVIDIA_VISIBLE_DEVICES": U[2],
        "ALIYUN_COM_GPU_MEM_IDX": "2",
        "ALIYUN_COM_GPU_MEM_POD": "6",
        "ALIYUN_COM_GPU_MEM_CONTAINER": "6",
        "ALIYUN_COM_GPU_MEM_DEV": "15",
    }
    assert not container.devices  # the runtime hook exposes the GPU, not the kubelet
    assert not container.cdi_devices


def test_allocate_adds_the_cdi_device_that_runs_the_hook(
    make_harness: Callable[..., Harness], fake_source: FakeSource
) -> None:
    h = make_harness(fake_source, cdi_device="aliyun.com/cgpu=shared")
    with h.client() as stub:
        response = stub.Allocate(allocate(h.ids(1, range(2)), h.ids(1, range(2, 3))))
    assert [[d.name for d in c.cdi_devices] for c in response.container_responses] == [
        ["aliyun.com/cgpu=shared"],
        ["aliyun.com/cgpu=shared"],
    ]


def test_allocate_spanning_gpus_or_unknown_ids_is_refused(harness: Harness) -> None:
    ids = harness.ids
    with harness.client() as stub:
        with pytest.raises(grpc.RpcError) as err:
            stub.Allocate(allocate(ids(0, range(3)) + ids(1, range(3))))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "spans GPUs 0" in err.value.details()
        assert "must come from one GPU" in err.value.details()

        with pytest.raises(grpc.RpcError) as err:
            stub.Allocate(allocate(ids(0, [15])))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown device ID" in err.value.details()


def _stale_socket(path: Path) -> None:
    """A socket file nobody listens on, as a crashed kubelet leaves behind."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))


def test_kubelet_restart_makes_the_plugin_serve_and_register_again(harness: Harness) -> None:
    harness.kubelet.next_registration()
    harness.wait_for(lambda: harness.plugin.registrations == 1, what="first registration")

    # The kubelet goes away; on its way back it deletes the plugin sockets.
    harness.kubelet.stop()
    harness.socket.unlink()
    _stale_socket(harness.kubelet.socket)  # refuses connections: registration must retry
    harness.wait_for(lambda: harness.socket.exists(), what="plugin socket served again")
    harness.wait_for(lambda: harness.plugin._last_error != "", what="a failed registration")
    assert harness.plugin.registrations == 1

    harness.kubelet.start()  # a new kubelet.sock
    again = harness.kubelet.next_registration()
    assert again.resource_name == "aliyun.com/gpu-mem"
    harness.wait_for(lambda: harness.plugin.registrations == 2, what="second registration")
    with harness.client() as stub:
        assert len(harness.watch(stub).next()) == 60


def test_kubelet_socket_recreated_alone_triggers_registration(harness: Harness) -> None:
    harness.kubelet.next_registration()
    harness.kubelet.stop()
    harness.kubelet.start()
    assert harness.kubelet.next_registration().endpoint == "aliyungpushare.sock"
    with harness.client() as stub:
        assert len(harness.watch(stub).next()) == 60


def test_mib_units_offer_one_device_per_mib(
    make_harness: Callable[..., Harness], fake_source: FakeSource
) -> None:
    h = make_harness(fake_source, unit_bytes=MIB)
    with h.client() as stub:
        devices = h.watch(stub).next(timeout=20)
        assert len(devices) == 4 * 15109
        env = stub.Allocate(allocate(h.ids(1, range(6000)))).container_responses[0].envs
    assert env["NVIDIA_VISIBLE_DEVICES"] == h.uuids[1]
    assert (env["ALIYUN_COM_GPU_MEM_CONTAINER"], env["ALIYUN_COM_GPU_MEM_DEV"]) == ("6000", "15109")


def test_device_list_larger_than_the_kubelet_accepts_is_refused(
    make_source: Callable[[int], FakeSource], sock_dir: Path
) -> None:
    config = Config(kubelet_socket=sock_dir / "kubelet.sock", unit_bytes=MIB)
    with pytest.raises(ValueError, match=r"use a larger --memory-unit") as err:
        DevicePlugin(make_source(8), config)  # 8 x 15109 one-MiB devices
    assert str(KUBELET_MAX_MESSAGE) in str(err.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--memory-unit", "KiB"], "invalid choice: 'KiB'"),
        (["--endpoint", "a/b.sock"], "--endpoint must be a plain file name"),
        (["--health-interval", "0"], "--health-interval must be positive"),
        (["--cdi-device", "cgpu"], "--cdi-device must look like vendor.com/class=name"),
        (["--scheduler-extender", "maybe"], "invalid choice: 'maybe'"),
    ],
)
def test_bad_flags_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_plugin_directory_is_refused(
    sock_dir: Path, fake_source: FakeSource, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--kubelet-socket", str(sock_dir / "absent" / "kubelet.sock")], fake_source)
    assert code == 2
    assert f"{sock_dir / 'absent'} is not a directory" in capsys.readouterr().err


def test_oversized_device_list_exits_with_a_clear_error(
    sock_dir: Path,
    make_source: Callable[[int], FakeSource],
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--kubelet-socket", str(sock_dir / "kubelet.sock"), "--memory-unit", "MiB"]
    assert main(argv, make_source(8)) == 2
    assert "use a larger --memory-unit" in capsys.readouterr().err
    assert not (sock_dir / "aliyungpushare.sock").exists()
