"""A real S3 server for the tests: Ceph's radosgw on loopback, through scripts/rgw.sh.

The session fixture `rgw` starts it once, the first time a test asks for it
(so a run without S3 tests starts nothing), and stops it at the end of the
session, from a finalizer and from atexit (whichever comes first). If Ceph
cannot be installed (not root, or apt unreachable) the S3 tests skip with
that reason; any other failure to start fails them, with the logs.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "rgw.sh"
_CANNOT_INSTALL = 3  # rgw.sh's exit code when Ceph cannot be installed


@dataclass
class Rgw:
    """A started radosgw: its endpoint, bucket and the env lines with the test keys."""

    dir: Path
    env: dict[str, str]
    cold_start_seconds: float
    _stopped: bool = field(default=False, repr=False)

    @property
    def endpoint(self) -> str:
        return self.env["CHECKPOINTD_TEST_S3_ENDPOINT"]

    @property
    def bucket(self) -> str:
        return self.env["CHECKPOINTD_TEST_S3_BUCKET"]

    def daemon_env(self) -> dict[str, str]:
        """The AWS variables a daemon reads its credentials from."""
        return {k: v for k, v in self.env.items() if k.startswith("AWS_")}

    def client(self) -> object:
        """A boto3 client with the test keys (for checks the daemon does not do)."""
        from checkpointd.storage.s3 import make_client

        saved = {k: os.environ.get(k) for k in self.daemon_env()}
        os.environ.update(self.daemon_env())
        try:
            return make_client(self.endpoint, "us-east-1")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def stop_gateway(self) -> None:
        """Kills the gateway alone: the S3 server goes away, the data stays."""
        subprocess.run([str(SCRIPT), "stop-gw", str(self.dir)], check=True, timeout=30)

    def start_gateway(self) -> None:
        subprocess.run([str(SCRIPT), "start-gw", str(self.dir)], check=True, timeout=90)

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            subprocess.run([str(SCRIPT), "stop", str(self.dir)], timeout=60, check=False)
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def rgw() -> Iterator[Rgw]:
    workdir = Path(tempfile.mkdtemp(prefix="checkpointd-rgw-"))
    started = time.monotonic()
    proc = subprocess.run([str(SCRIPT), "start", str(workdir)], capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        subprocess.run([str(SCRIPT), "stop", str(workdir)], timeout=60, check=False)
        shutil.rmtree(workdir, ignore_errors=True)
        if proc.returncode == _CANNOT_INSTALL:
            pytest.skip(f"no S3 server for the S3 tests: {proc.stderr.strip()}")
        pytest.fail(f"scripts/rgw.sh start failed (exit {proc.returncode}):\n{proc.stderr}{proc.stdout}")
    env = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    server = Rgw(workdir, env, seconds)
    atexit.register(server.stop)  # also if the session is cut short
    print(f"\nradosgw started in {seconds:.1f}s at {server.endpoint}", file=sys.stderr)
    try:
        yield server
    finally:
        server.stop()
