"""Following gpushare's scheduler extender: pod choice, the API client against a fake API server,
and Allocate over gRPC using the extender's GPU."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import grpc
import pytest

from cgpu_km.deviceplugin import api_pb2
from cgpu_km.deviceplugin.extender import (
    AssumedPod,
    ExtenderLink,
    KubeClient,
    KubeError,
    assumed_pod,
    pod_units,
)
from cgpu_km.deviceplugin.plugin import DevicePlugin, extender_link
from tests.deviceplugin.doubles import FakeSource, Harness

RESOURCE = "aliyun.com/gpu-mem"


def pod(
    name: str,
    units: list[int],
    idx: str | None = None,
    assigned: str = "false",
    assume_time: int = 0,
    namespace: str = "default",
) -> dict[str, Any]:
    annotations = {"ALIYUN_COM_GPU_MEM_ASSIGNED": assigned}
    if idx is not None:
        annotations |= {
            "ALIYUN_COM_GPU_MEM_IDX": idx,
            "ALIYUN_COM_GPU_MEM_ASSUME_TIME": str(assume_time),
        }
    return {
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
        "spec": {
            "containers": [
                {"name": f"c{i}", "resources": {"limits": {RESOURCE: str(u)}}}
                for i, u in enumerate(units)
            ]
            + [{"name": "sidecar", "resources": {}}]
        },
    }


# --- the pure choice ----------------------------------------------------------


def test_pod_units_sum_the_containers_limits() -> None:
    assert pod_units(pod("p", [2, 4]), RESOURCE) == 6
    assert pod_units(pod("p", []), RESOURCE) == 0


def test_assumed_pod_is_the_oldest_unassigned_with_the_same_units() -> None:
    pods = [
        pod("done", [6], idx="0", assigned="true", assume_time=1),
        pod("no-idx", [6]),
        pod("other-size", [4], idx="1", assume_time=2),
        pod("newer", [6], idx="2", assume_time=20),
        pod("older", [3, 3], idx="3", assume_time=10, namespace="team"),
        pod("bad-idx", [6], idx="x", assume_time=5),
    ]
    assert assumed_pod(pods, 6, RESOURCE) == AssumedPod("team", "older", 3)
    assert assumed_pod(pods, 4, RESOURCE) == AssumedPod("default", "other-size", 1)
    assert assumed_pod(pods, 7, RESOURCE) is None
    assert assumed_pod([], 6, RESOURCE) is None


# --- a fake API server ----------------------------------------------------------


class FakeApiServer:
    """Pods and node-status patches over HTTP, recording every request."""

    def __init__(self) -> None:
        self.pods: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self.fail_with = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, code: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self) -> Any:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length)) if length else None
                server.requests.append((self.command, self.path, dict(self.headers), body))
                return body

            def do_GET(self) -> None:
                self._record()
                if server.fail_with:
                    self._reply(server.fail_with, {"message": "forbidden"})
                    return
                self._reply(200, {"kind": "PodList", "items": server.pods})

            def do_PATCH(self) -> None:
                body = self._record()
                if server.fail_with:
                    self._reply(server.fail_with, {"message": "forbidden"})
                    return
                parts = urlsplit(self.path).path.split("/")
                if "pods" in parts:
                    name = parts[-1]
                    for p in server.pods:
                        if p["metadata"]["name"] == name:
                            p["metadata"]["annotations"].update(body["metadata"]["annotations"])
                self._reply(200, {})

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def patches(self, kind: str) -> list[tuple[str, Any]]:
        return [
            (path, body)
            for method, path, _, body in self.requests
            if method == "PATCH" and kind in path
        ]


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    yield server
    server.close()


@pytest.fixture
def link(api: FakeApiServer) -> ExtenderLink:
    return ExtenderLink(KubeClient(api.url, token="s3cret"), "node-1", RESOURCE)


def test_client_lists_pending_pods_of_its_node_with_the_token(
    api: FakeApiServer, link: ExtenderLink
) -> None:
    api.pods = [pod("a", [6], idx="1")]
    assert link.find(6) == AssumedPod("default", "a", 1)
    method, path, headers, _ = api.requests[0]
    assert method == "GET"
    url = urlsplit(path)
    assert url.path == "/api/v1/pods"
    assert parse_qs(url.query)["fieldSelector"] == ["spec.nodeName=node-1,status.phase=Pending"]
    assert headers["Authorization"] == "Bearer s3cret"


def test_client_marks_pods_and_publishes_gpu_count(api: FakeApiServer, link: ExtenderLink) -> None:
    api.pods = [pod("a", [6], idx="1", namespace="ml")]
    link.mark_assigned(AssumedPod("ml", "a", 1))
    link.publish_gpu_count(4)
    assert api.patches("pods") == [
        (
            "/api/v1/namespaces/ml/pods/a",
            {"metadata": {"annotations": {"ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}}},
        )
    ]
    assert api.patches("nodes") == [
        ("/api/v1/nodes/node-1/status", {"status": {"capacity": {"aliyun.com/gpu-count": "4"}}})
    ]
    assert all(
        h["Content-Type"] == "application/merge-patch+json"
        for m, _, h, _ in api.requests
        if m == "PATCH"
    )


def test_client_errors_name_the_call_and_status(api: FakeApiServer, link: ExtenderLink) -> None:
    api.fail_with = 403
    with pytest.raises(
        KubeError, match=r"GET /api/v1/pods\?fieldSelector=.*: HTTP 403 .*forbidden"
    ):
        link.find(6)
    unreachable = KubeClient("http://127.0.0.1:1")
    with pytest.raises(KubeError, match="GET /api/v1/pods"):
        unreachable.pending_pods_on("node-1")


def test_in_cluster_needs_a_pod_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeError, match="not in a Kubernetes pod"):
        KubeClient.in_cluster(tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    with pytest.raises(KubeError, match="no service-account token"):
        KubeClient.in_cluster(tmp_path)
    (tmp_path / "token").write_text("t\n")
    with pytest.raises(KubeError, match="no usable service-account CA certificate"):
        KubeClient.in_cluster(tmp_path)


def test_extender_modes() -> None:
    def no_cluster() -> KubeClient:
        raise KubeError("not in a Kubernetes pod")

    def cluster() -> KubeClient:
        return KubeClient("http://127.0.0.1:1")

    assert extender_link("off", "n", RESOURCE, cluster) is None
    assert extender_link("auto", "", RESOURCE, cluster) is None
    assert extender_link("auto", "n", RESOURCE, no_cluster) is None
    linked = extender_link("auto", "n", RESOURCE, cluster)
    assert linked is not None
    assert linked.node == "n"
    with pytest.raises(KubeError, match="no node name"):
        extender_link("on", "", RESOURCE, cluster)
    with pytest.raises(KubeError, match="not in a Kubernetes pod"):
        extender_link("on", "n", RESOURCE, no_cluster)


# --- the plugin following the extender ---------------------------------------------


def allocate(ids: list[str]) -> api_pb2.AllocateRequest:
    return api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]
    )


def test_allocate_uses_the_gpu_the_extender_chose(
    make_harness: Callable[..., Harness],
    fake_source: FakeSource,
    api: FakeApiServer,
    link: ExtenderLink,
) -> None:
    api.pods = [pod("trainer", [6], idx="3", assume_time=7)]
    h = make_harness(fake_source, extender=link)
    with h.client() as stub:
        env = stub.Allocate(allocate(h.ids(0, range(6)))).container_responses[0].envs
        assert (env["NVIDIA_VISIBLE_DEVICES"], env["ALIYUN_COM_GPU_MEM_IDX"]) == (h.uuids[3], "3")
        assert (env["ALIYUN_COM_GPU_MEM_CONTAINER"], env["ALIYUN_COM_GPU_MEM_DEV"]) == ("6", "15")
        assert api.pods[0]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "true"

        # No pod left for the extender to have placed: the device IDs decide.
        env = stub.Allocate(allocate(h.ids(1, range(6)))).container_responses[0].envs
        assert env["ALIYUN_COM_GPU_MEM_IDX"] == "1"


def test_allocate_fails_clearly_when_the_api_server_cannot_tell(
    make_harness: Callable[..., Harness],
    fake_source: FakeSource,
    api: FakeApiServer,
    link: ExtenderLink,
) -> None:
    h = make_harness(fake_source, extender=link)
    api.fail_with = 503
    with h.client() as stub, pytest.raises(grpc.RpcError) as err:
        stub.Allocate(allocate(h.ids(0, range(2))))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot ask the API server which GPU the scheduler chose" in err.value.details()


def test_extender_choosing_a_missing_gpu_is_refused_and_leaves_the_pod(
    make_harness: Callable[..., Harness],
    fake_source: FakeSource,
    api: FakeApiServer,
    link: ExtenderLink,
) -> None:
    api.pods = [pod("lost", [2], idx="7")]
    h = make_harness(fake_source, extender=link)
    with h.client() as stub, pytest.raises(grpc.RpcError) as err:
        stub.Allocate(allocate(h.ids(0, range(2))))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "chose GPU 7, which this node does not have" in err.value.details()
    assert api.pods[0]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "false"


def test_gpu_count_is_published_after_registration(
    make_harness: Callable[..., Harness],
    fake_source: FakeSource,
    api: FakeApiServer,
    link: ExtenderLink,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api.fail_with = 500  # the first attempts fail: the plugin retries
    monkeypatch.setattr(DevicePlugin, "publish_retry", 0.05)
    h = make_harness(fake_source, extender=link)
    h.kubelet.next_registration()
    h.wait_for(lambda: len(api.patches("nodes")) >= 2, what="retried node patch")
    api.fail_with = 0
    h.wait_for(lambda: h.plugin._gpu_count_published, what="gpu-count published")
    assert api.patches("nodes")[-1] == (
        "/api/v1/nodes/node-1/status",
        {"status": {"capacity": {"aliyun.com/gpu-count": "4"}}},
    )
