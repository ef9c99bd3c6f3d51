"""A fleet on one machine for test_fleet: hosts (netns.py), one S3 server they reach, a daemon per host, trainers.

- `start_rgw(workdir, bind)`: a radosgw of the fleet's own (scripts/rgw.sh
  with RGW_BIND), its gateway on the bridge address the hosts reach; the
  session's loopback rgw (rgw.py) stays as the other tests know it.
- `Fleet`: one bucket prefix; `start(i)` runs `checkpointd serve` on host i
  (in its namespace, bound to the host's address, `--port 0` and a port
  file read from the root namespace, its own --shm-dir and --work-dir),
  `trainer(i, ...)` runs tests/integration/support/trainers/fleet_trainer.py there; the
  bucket's manifests, lease objects and `checkpointd verify` are read from
  the root namespace. `close()` kills every trainer it started, then stops
  every daemon (SIGTERM to all at once, SIGKILL past 30 s).
- `Proc`: a trainer whose JSON lines are read by a thread, so a test waits
  for the next one with a deadline and a dead trainer fails with its log.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import secrets
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from bench import rgw
from bench.rgw import Rgw
from tests.integration.support.daemon import Daemon, start_daemon
from tests.integration.support.netns import NETNS, Hosts

REPO = Path(__file__).resolve().parents[3]
MANIFEST = "checkpointd.manifest.json"
LEASES = ".checkpointd-leases"  # S3Leases' objects, under the store's reserved prefix
# How long a trainer may say nothing: TensorFlow's import and a DQN's build in
# 9 processes at once (CHECKPOINTD_FLEET=1) took over 3 minutes on 2 busy cores.
SAYS_NOTHING_SECONDS = 600.0


def start_rgw(workdir: Path, bind: str) -> Rgw:
    """A radosgw whose gateway listens on `bind`; skips the test if Ceph cannot be installed."""
    try:
        server = rgw.start(workdir, bind=bind)
    except rgw.Unavailable as e:
        if e.cannot_install:
            pytest.skip(f"no S3 server for the fleet tests: {e}")
        pytest.fail(str(e))
    atexit.register(server.stop)  # also if the session is cut short; the fixture stops it first
    return server


class Proc:
    """A process on a host that reports one JSON object a line on stdout."""

    def __init__(self, argv: list[str], log: Path, stdin: bool = False) -> None:
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 - closed in kill()
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=self._log,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        )  # fmt: skip
        self._lines: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._lines.put(json.loads(line))
            except json.JSONDecodeError:  # a library printing on stdout
                self._log.write(line.encode())
        self._lines.put(None)

    def next(self, timeout: float = SAYS_NOTHING_SECONDS) -> dict[str, Any]:
        """The next JSON line; fails with the log if the process ends or says nothing in time."""
        try:
            message = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.proc.args[-5:]} said nothing in {timeout:g}s:\n{self.log()}") from None
        if message is None:
            self._lines.put(None)  # later calls fail the same way
            raise AssertionError(f"{self.proc.args[-5:]} exited with {self.proc.wait()}:\n{self.log()}")
        return message

    def expect(self, key: str, timeout: float = SAYS_NOTHING_SECONDS) -> dict[str, Any]:
        """The next JSON line, which must have `key`."""
        message = self.next(timeout)
        assert key in message, f"expected {key!r}, got {message}"
        return message

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait(self, timeout: float = SAYS_NOTHING_SECONDS) -> int:
        return self.proc.wait(timeout)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


class Fleet:
    """One bucket prefix shared by a daemon on every host, and the trainers started on them."""

    def __init__(self, hosts: Hosts, rgw: Rgw, tmp: Path, *, lease_seconds: float) -> None:
        self.hosts = hosts
        self.rgw = rgw
        self.tmp = tmp
        self.lease_seconds = lease_seconds
        self.prefix = f"fleet-{secrets.token_hex(4)}"
        self.client: Any = rgw.client()
        self.daemons: list[Daemon | None] = [None] * len(hosts)
        self.procs: list[Proc] = []
        self._started = 0

    @property
    def url(self) -> str:
        return f"s3://{self.rgw.bucket}/{self.prefix}"

    def s3_args(self) -> list[str]:
        return ["--s3-endpoint-url", self.rgw.endpoint, "--s3-region", "us-east-1"]

    def start(self, i: int) -> Daemon:
        """Starts (or restarts) host i's daemon; its state and shared-memory dirs are the host's own."""
        host = self.hosts[i]
        self._started += 1
        lease = ["--lease-seconds", f"{self.lease_seconds:g}", "--lease-idle-seconds", "60"]
        insecure = ["--insecure"] if self.hosts.mode == NETNS else []  # a private bridge, no TLS in the tests
        d = start_daemon(
            self.url,  # type: ignore[arg-type]  # passed to --root as str(root)
            self.tmp / f"work-{host.name}-{self._started}",
            "--work-dir", str(self.tmp / f"state-{host.name}"), "--shm-dir", str(host.shm_dir),
            *self.s3_args(), *lease, *insecure,
            env=self.rgw.daemon_env(), host=host.address, wrap=host.command([]),
        )  # fmt: skip
        self.daemons[i] = d
        return d

    def daemon(self, i: int) -> Daemon:
        d = self.daemons[i]
        assert d is not None, f"no daemon on host {self.hosts[i].name}"
        return d

    def ensure_all(self) -> None:
        """Every host has a live daemon (a test before may have killed one)."""
        for i, d in enumerate(self.daemons):
            if d is None or d.proc.poll() is not None:
                self.start(i)

    def kill_daemon(self, i: int) -> None:
        d = self.daemon(i)
        d.proc.kill()
        d.proc.wait()

    def trainer(self, i: int, mode: str, *args: str, stdin: bool = False) -> Proc:
        """`fleet_trainer MODE ADDRESS ARGS...` on host i, dialling host i's daemon."""
        host = self.hosts[i]
        argv = host.command(
            [
                sys.executable,
                "-m",
                "tests.integration.support.trainers.fleet_trainer",
                mode,
                self.daemon(i).address,
                *args,
            ]
        )
        proc = Proc(argv, self.tmp / f"trainer-{host.name}-{len(self.procs)}.log", stdin=stdin)
        self.procs.append(proc)
        return proc

    def manifests(self, run: str) -> dict[str, dict[str, Any]]:
        """Every committed save of `run` in the bucket: export dir -> manifest document."""
        prefix = f"{self.prefix}/{run}/"
        found: dict[str, dict[str, Any]] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.rgw.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.endswith(MANIFEST):
                    body = self.client.get_object(Bucket=self.rgw.bucket, Key=key)["Body"].read()
                    rel = key[len(prefix) : -len(MANIFEST)].rstrip("/.")
                    found[rel] = json.loads(body)
        return found

    def lease(self, run: str) -> dict[str, Any] | None:
        """The run's lease object in the bucket, or None."""
        key = f"{self.prefix}/{LEASES}/{run}.json"
        try:
            body = self.client.get_object(Bucket=self.rgw.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None
        return json.loads(body)

    def verify(self, *paths: str) -> subprocess.CompletedProcess[str]:
        """`checkpointd verify` of the bucket (or of `paths` under it), from the root namespace."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        return subprocess.run(
            [sys.executable, "-m", "checkpointd", "verify", *(paths or (self.url,)), *self.s3_args()],
            capture_output=True, text=True, timeout=300, env={**env, **self.rgw.daemon_env()},
        )  # fmt: skip

    def close(self) -> None:
        """Kills every trainer, then stops every daemon (SIGTERM, SIGKILL past 30 s)."""
        for p in self.procs:
            p.kill()
        live = [d for d in self.daemons if d is not None and d.proc.poll() is None]
        for d in live:  # all at once: each lets go of its leases while the others do
            d.proc.terminate()
        for d in live:
            try:
                d.proc.wait(30)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait()
