"""Working with gpushare's scheduler extender, through the Kubernetes API.

In a cluster, gpushare-schd-extender picks the GPU when it binds a pod and
records it in annotations (`ALIYUN_COM_GPU_MEM_IDX`, `..._ASSIGNED=false`,
`..._ASSUME_TIME`). The kubelet then calls Allocate with device IDs that only
count units, so, as gpushare's own plugin does, Allocate looks for the pending
pod on this node that the extender assumed with the same number of units
(oldest first), uses its GPU, and marks it `ALIYUN_COM_GPU_MEM_ASSIGNED=true`.
The plugin also publishes the node's GPU count as `aliyun.com/gpu-count`,
which the extender reads. The choice of pod is pure (`assumed_pod`); the HTTP
client is a few urllib calls with the pod's service-account credentials.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ANNOTATION_IDX = "ALIYUN_COM_GPU_MEM_IDX"
ANNOTATION_ASSIGNED = "ALIYUN_COM_GPU_MEM_ASSIGNED"
ANNOTATION_ASSUME_TIME = "ALIYUN_COM_GPU_MEM_ASSUME_TIME"
GPU_COUNT_RESOURCE = "aliyun.com/gpu-count"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeError(Exception):
    """A Kubernetes API call failed; the message says which and why."""


@dataclass(frozen=True)
class AssumedPod:
    namespace: str
    name: str
    gpu_index: int


def pod_units(pod: Mapping[str, Any], resource: str) -> int:
    """The pod's total request of `resource` (from limits, as extended resources are)."""
    total = 0
    for container in pod.get("spec", {}).get("containers", []):
        resources = container.get("resources", {})
        value = resources.get("limits", {}).get(resource) or resources.get("requests", {}).get(
            resource
        )
        if value is not None:
            total += int(value)
    return total


def assumed_pod(pods: Sequence[Mapping[str, Any]], units: int, resource: str) -> AssumedPod | None:
    """The pod the extender placed with `units` units and no device yet: oldest assume time."""
    candidates: list[tuple[int, str, AssumedPod]] = []
    for pod in pods:
        meta = pod.get("metadata", {})
        notes = meta.get("annotations") or {}
        if notes.get(ANNOTATION_ASSIGNED) != "false" or ANNOTATION_IDX not in notes:
            continue
        if pod_units(pod, resource) != units:
            continue
        try:
            index = int(notes[ANNOTATION_IDX])
            assume_time = int(notes.get(ANNOTATION_ASSUME_TIME, "0"))
        except ValueError:
            continue
        namespace, name = meta.get("namespace", "default"), meta.get("name", "")
        candidates.append((assume_time, f"{namespace}/{name}", AssumedPod(namespace, name, index)))
    if not candidates:
        return None
    return min(candidates, key=lambda c: (c[0], c[1]))[2]


class KubeClient:
    """The few API calls the plugin makes, with a bearer token over HTTPS (or plain HTTP in
    tests)."""

    def __init__(
        self, base_url: str, token: str = "", ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._ssl = ssl_context

    @classmethod
    def in_cluster(cls, account: Path = SERVICE_ACCOUNT) -> KubeClient:
        """From the pod's environment and service account; KubeError when not in a pod."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KubeError("not in a Kubernetes pod: KUBERNETES_SERVICE_HOST is not set")
        try:
            token = (account / "token").read_text().strip()
        except OSError as err:
            raise KubeError(f"no service-account token: {err}") from None
        try:
            context = ssl.create_default_context(cafile=str(account / "ca.crt"))
        except (OSError, ssl.SSLError) as err:
            raise KubeError(f"no usable service-account CA certificate: {err}") from None
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", token, context)

    def _call(self, method: str, path: str, body: object = None, content_type: str = "") -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method)
        request.add_header("Accept", "application/json")
        if self._token:
            request.add_header("Authorization", f"Bearer {self._token}")
        if content_type:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, timeout=10, context=self._ssl) as response:
                return json.load(response)
        except urllib.error.HTTPError as err:
            detail = err.read(500).decode(errors="replace").strip()
            raise KubeError(f"{method} {path}: HTTP {err.code} {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise KubeError(f"{method} {path}: {err}") from None

    def pending_pods_on(self, node: str) -> list[dict[str, Any]]:
        selector = urllib.parse.quote(f"spec.nodeName={node},status.phase=Pending")
        items: list[dict[str, Any]] = self._call("GET", f"/api/v1/pods?fieldSelector={selector}")[
            "items"
        ]
        return items

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        path = f"/api/v1/namespaces/{urllib.parse.quote(namespace)}/pods/{urllib.parse.quote(name)}"
        patch = {"metadata": {"annotations": dict(annotations)}}
        self._call("PATCH", path, patch, "application/merge-patch+json")

    def set_node_capacity(self, node: str, capacity: Mapping[str, str]) -> None:
        path = f"/api/v1/nodes/{urllib.parse.quote(node)}/status"
        patch = {"status": {"capacity": dict(capacity)}}
        self._call("PATCH", path, patch, "application/merge-patch+json")


class ExtenderLink:
    """What the plugin asks of the cluster: which GPU the extender chose, and telling it the
    GPU count."""

    def __init__(self, client: KubeClient, node: str, resource: str) -> None:
        self.client = client
        self.node = node
        self.resource = resource

    def find(self, units: int) -> AssumedPod | None:
        """The pod the extender assumed on this node with `units` units; None when it placed
        no such pod. KubeError when the API cannot tell."""
        return assumed_pod(self.client.pending_pods_on(self.node), units, self.resource)

    def mark_assigned(self, pod: AssumedPod) -> None:
        self.client.annotate_pod(pod.namespace, pod.name, {ANNOTATION_ASSIGNED: "true"})

    def publish_gpu_count(self, count: int) -> None:
        self.client.set_node_capacity(self.node, {GPU_COUNT_RESOURCE: str(count)})
