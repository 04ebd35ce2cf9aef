"""The checked-in gRPC code is what regenerate.sh makes from api.proto (stale-code guard)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "cgpu_km" / "deviceplugin"
GENERATED = ["api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"]
# Version stamps differ between patch releases of grpcio-tools; the code must not.
VERSION_LINE = re.compile(
    r"^.*(Version|VERSION|_runtime_version\.Domain|^\s+\d+,$).*$", re.MULTILINE
)


def normalized(text: str) -> str:
    return VERSION_LINE.sub("<version>", text)


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", f"-I{REPO}",
            f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
            str(PACKAGE / "api.proto"),
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for name in GENERATED:
        fresh = (tmp_path / "cgpu_km" / "deviceplugin" / name).read_text()
        checked_in = (PACKAGE / name).read_text()
        assert normalized(fresh) == normalized(checked_in), (
            f"{name} is stale: run cgpu_km/deviceplugin/regenerate.sh"
        )


def test_wire_names_are_the_kubelets() -> None:
    from cgpu_km.deviceplugin import api_pb2

    services = api_pb2.DESCRIPTOR.services_by_name
    assert services["Registration"].full_name == "v1beta1.Registration"
    assert [m.name for m in services["DevicePlugin"].methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]
