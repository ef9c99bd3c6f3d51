"""Ceph's radosgw on loopback through scripts/rgw.sh: the one wrapper the tests and the bench start it with.

`start(directory)` runs `scripts/rgw.sh start` and returns the server, or
raises `Unavailable` saying why (with `cannot_install` when Ceph's packages
cannot be installed here: not root, or apt unreachable; the tests then skip
and the bench says so). `radosgw(directory)` is the same as a block that
stops the server and removes its dir however it ends. The tests' session
fixture is tests/integration/support/rgw.py's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RGW_SCRIPT = ROOT / "scripts" / "rgw.sh"
CANNOT_INSTALL = 3  # rgw.sh's exit code when Ceph cannot be installed
REGION = "us-east-1"


class Unavailable(RuntimeError):
    """radosgw did not start; the message has rgw.sh's exit code and output."""

    def __init__(self, message: str, *, cannot_install: bool) -> None:
        super().__init__(message)
        self.cannot_install = cannot_install


@dataclass
class Rgw:
    """A started radosgw: its dir, the env lines rgw.sh printed (endpoint, bucket, test keys)."""

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
        """The AWS variables a daemon (or a boto3 client) reads its credentials from."""
        return {k: v for k, v in self.env.items() if k.startswith("AWS_")}

    def client(self) -> object:
        """A boto3 client with the test keys (for checks the daemon does not do)."""
        from checkpointd.storage.s3 import make_client

        saved = {k: os.environ.get(k) for k in self.daemon_env()}
        os.environ.update(self.daemon_env())
        try:
            return make_client(self.endpoint, REGION)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def stop_gateway(self) -> None:
        """Kills the gateway alone: the S3 server goes away, the data stays."""
        subprocess.run([str(RGW_SCRIPT), "stop-gw", str(self.dir)], check=True, timeout=30)

    def start_gateway(self) -> None:
        subprocess.run([str(RGW_SCRIPT), "start-gw", str(self.dir)], check=True, timeout=90)

    def stop(self) -> None:
        """Stops every process of it and removes its dir (once; later calls do nothing)."""
        if not self._stopped:
            self._stopped = True
            subprocess.run([str(RGW_SCRIPT), "stop", str(self.dir)], timeout=120, check=False)
            shutil.rmtree(self.dir, ignore_errors=True)


def start(directory: Path, bind: str | None = None) -> Rgw:
    """Starts radosgw in `directory` (new or empty); its gateway on `bind` (rgw.sh's RGW_BIND) if given.

    Raises:
        Unavailable: it did not start; whatever it started is stopped and `directory` removed.
    """
    started = time.monotonic()
    env = {**os.environ, "RGW_BIND": bind} if bind is not None else None
    proc = subprocess.run(
        [str(RGW_SCRIPT), "start", str(directory)], capture_output=True, text=True, timeout=600, env=env
    )
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        subprocess.run([str(RGW_SCRIPT), "stop", str(directory)], timeout=120, check=False)
        shutil.rmtree(directory, ignore_errors=True)
        raise Unavailable(
            f"{'RGW_BIND=' + bind + ' ' if bind else ''}scripts/rgw.sh start failed (exit {proc.returncode}): "
            f"{proc.stderr.strip()}{proc.stdout.strip()}",
            cannot_install=proc.returncode == CANNOT_INSTALL,
        )
    lines = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    return Rgw(Path(directory), lines, seconds)


def unavailable(error: Unavailable, log: Path) -> str:
    """Why a bench section runs without S3: one line, the whole output left in `log`."""
    log.write_text(str(error))
    why = "Ceph cannot be installed" if error.cannot_install else "radosgw did not start"
    said = [line[line.index("rgw.sh:") :] for line in str(error).splitlines() if "rgw.sh:" in line]
    return f"{why} ({'; '.join(said) or 'no message'}; log {log})"


@contextlib.contextmanager
def radosgw(directory: Path) -> Iterator[tuple[Rgw | None, str]]:
    """`start` as a block: (Rgw, "") or, if it cannot start, (None, why); stopped however the block ends."""
    try:
        server = start(directory)
    except Unavailable as e:
        yield None, str(e)
        return
    try:
        yield server, ""
    finally:
        server.stop()
