#!/bin/sh
# Regenerate the checked-in gRPC code for the kubelet device plugin API.
#
# api.proto is the kubelet's v1beta1 device plugin API, copied verbatim from
# kubernetes/kubernetes staging/src/k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/api.proto
# (mirrored as kubernetes/kubelet pkg/apis/deviceplugin/v1beta1/api.proto, commit
# 3c7be0577afb3dfbff2946b47c3b3ccf51a30b24). That version carries no gogoproto
# options; older copies do: delete the `import "github.com/gogo/protobuf/..."` line
# and every `option (gogoproto.*)` line before compiling. The proto package
# `v1beta1` must stay as it is: the gRPC method names on the wire derive from it.
#
# Run from anywhere with the project venv: cgpu_km/deviceplugin/regenerate.sh
# Uses the grpcio-tools in .venv, whose protoc version must not be newer than
# the protobuf runtime (pyproject pins both).
set -eu
repo=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
cd "$repo"
"$python" -m grpc_tools.protoc -I. \
    --python_out=. --pyi_out=. --grpc_python_out=. \
    cgpu_km/deviceplugin/api.proto
