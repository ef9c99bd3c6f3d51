"""The committed gencode is exactly what scripts/gen_protos.sh makes from protos/.

If this fails, the .proto changed without regenerating, or the generator is not
the pinned grpcio-tools: run scripts/gen_protos.sh and commit service/checkpointd/v1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
COMMITTED = REPO / "service" / "checkpointd" / "v1"
# protoc on one small proto; generous for a slow CI machine.
LIMIT = 60.0


def generated_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if "_pb2" in p.name}


def test_regenerated_code_is_byte_identical_to_the_committed_code(tmp_path: Path) -> None:
    # The script runs `python -m grpc_tools.protoc`: put this venv's python first.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path}

    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gen_protos.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=LIMIT,
    )

    assert done.returncode == 0, done.stderr
    fresh = generated_files(tmp_path / "checkpointd" / "v1")
    committed = generated_files(COMMITTED)
    assert sorted(fresh) == [
        "checkpointd_pb2.py",
        "checkpointd_pb2.pyi",
        "checkpointd_pb2_grpc.py",
        "tf_formats_pb2.py",
        "tf_formats_pb2.pyi",
        "tf_formats_pb2_grpc.py",
    ]
    assert sorted(fresh) == sorted(committed)
    for name in fresh:
        assert fresh[name] == committed[name], f"{name} differs from a fresh generation"


def test_grpc_stubs_import_the_package_path_without_patching() -> None:
    text = (COMMITTED / "checkpointd_pb2_grpc.py").read_text()
    assert "from checkpointd.v1 import checkpointd_pb2" in text
