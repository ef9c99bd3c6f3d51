#!/usr/bin/env bash
# Regenerates service/checkpointd/v1/ from protos/. Needs grpcio-tools==1.62.3
# (pinned in pyproject's test extra): newer gencode needs protobuf 5, which
# TensorFlow 2.15 refuses. The output is committed; tests/unit/tools/test_gencode.py
# regenerates it into a temp dir and diffs.
set -euo pipefail
out="${1:-service}"
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I protos \
  --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  protos/checkpointd/v1/checkpointd.proto protos/checkpointd/v1/tf_formats.proto
