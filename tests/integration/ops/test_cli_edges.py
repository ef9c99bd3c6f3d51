"""The CLI's start-up refusals and S3 setup with real processes: one line that says what to do.

A busy gRPC port is refused without grpcio's own lines before ours; a
missing bucket names the command that creates it; AWS_ENDPOINT_URL points
`verify` at the local S3 server (radosgw) without --s3-endpoint-url.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.support.rgw import Rgw

TIMEOUT = 60.0


def checkpointd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checkpointd", *args], capture_output=True, text=True, timeout=TIMEOUT, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
    )  # fmt: skip


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_busy_port_prints_our_line_alone(tmp_path: Path, busy_port: int) -> None:
    done = checkpointd(
        "serve", "--root", str(tmp_path / "root"), "--port", str(busy_port), "--metrics-port", "-1", "--no-shm"
    )
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr  # no "Failed to add port", no absl note before it
    assert f"cannot start: cannot bind gRPC to 127.0.0.1:{busy_port}: Address already in use" in lines[0]


def test_a_missing_bucket_says_how_to_create_it_and_that_command_works(rgw: Rgw, tmp_path: Path) -> None:
    bucket = f"made-{os.getpid()}"
    args = ("--port", "0", "--metrics-port", "-1", "--no-shm", "--work-dir", str(tmp_path / "w"))
    done = checkpointd(
        "serve", "--root", f"s3://{bucket}/x", "--s3-endpoint-url", rgw.endpoint, *args, env=rgw.daemon_env()
    )
    assert done.returncode == 2
    (line,) = [line for line in done.stderr.splitlines() if "cannot start:" in line]
    assert f"cannot start: bucket {bucket!r} does not exist" in line
    command = line.split("without the AWS CLI: ", 1)[1].rstrip(")")
    assert command.startswith("python -c ")
    made = subprocess.run(
        [sys.executable, "-c", command.removeprefix("python -c ").strip('"')],
        capture_output=True, text=True, timeout=TIMEOUT, check=False, env={**os.environ, **rgw.daemon_env()},
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    checked = checkpointd("verify", f"s3://{bucket}", "--s3-endpoint-url", rgw.endpoint, env=rgw.daemon_env())
    assert checked.returncode == 0 and "0 OK, 0 FAILED" in checked.stdout, checked.stderr  # it exists now, empty


def test_aws_endpoint_url_points_verify_at_the_local_server(rgw: Rgw) -> None:
    env = {**rgw.daemon_env(), "AWS_ENDPOINT_URL": rgw.endpoint}
    done = checkpointd("verify", f"s3://{rgw.bucket}/none-{os.getpid()}", env=env)
    assert done.returncode == 0, done.stderr
    without = checkpointd(
        "verify", f"s3://{rgw.bucket}/none", env={**rgw.daemon_env(), "AWS_ENDPOINT_URL": "", "AWS_MAX_ATTEMPTS": "1"}
    )
    assert without.returncode == 2
    assert "give --s3-endpoint-url URL or set AWS_ENDPOINT_URL" in without.stderr, without.stderr
