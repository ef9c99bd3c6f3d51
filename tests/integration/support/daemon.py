"""Starts and stops a real `checkpointd serve` subprocess for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

START_TIMEOUT = 60.0


@dataclass
class Daemon:
    proc: subprocess.Popen
    root: Path
    port: int
    metrics_port: int
    log_path: Path
    # What start_daemon connected with; None for a plaintext daemon.
    credentials: grpc.ChannelCredentials | None = None
    host: str = "127.0.0.1"  # the address its gRPC port is bound to (serve --host)

    def channel(self, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
        """A channel to the daemon: plaintext, or TLS with these (default: the daemon's) credentials."""
        credentials = credentials or self.credentials
        if credentials is None:
            return grpc.insecure_channel(self.address)
        return grpc.secure_channel(self.address, credentials)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_recovered(self, timeout: float = START_TIMEOUT) -> None:
        """Waits until the start's recovery has finished (an object store's tidy runs after the daemon serves)."""
        from tests.integration.support.scrape import Metrics

        wait_until(lambda: Metrics(self.metrics_url)("checkpointd_recovery_done") == 1, "recovery done", timeout)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for the drain; SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


def _wait_for_file(path: Path, proc: subprocess.Popen, deadline: float, log: Path) -> str:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}:\n{log.read_text()}")
        if path.exists():
            return path.read_text().strip()
        time.sleep(0.05)  # polling a file for a result, with a deadline
    raise TimeoutError(f"daemon wrote no {path.name} in time:\n{log.read_text()}")


def start_daemon(
    root: Path,
    workdir: Path,
    *extra: str,
    credentials: grpc.ChannelCredentials | None = None,
    env: Mapping[str, str] | None = None,
    host: str | None = None,
    wrap: Sequence[str] = (),
    python: str = sys.executable,
) -> Daemon:
    """Runs `checkpointd serve --port 0` and waits until health says SERVING.

    Args:
        root, workdir: the daemon's --root, and where its port files and log go.
        extra: more `serve` arguments.
        credentials: TLS channel credentials for the health check, for a
            daemon started with --tls-cert (health needs no token).
        env: extra environment variables for the daemon (e.g. CHECKPOINTD_TOKENS).
        host: serve --host, and the address the health check dials
            (default: serve's own, 127.0.0.1).
        wrap: a command the daemon runs under, e.g. `ip netns exec NS`
            for a daemon on another host of the fleet tests (it must exec,
            so the process is the daemon's).
        python: the interpreter that runs the daemon (another venv's, e.g. one without TensorFlow).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port_file, metrics_file = workdir / "port", workdir / "metrics-port"
    for f in (port_file, metrics_file):
        f.unlink(missing_ok=True)
    log_path = workdir / "daemon.log"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                *wrap,
                python,
                "-m",
                "checkpointd",
                "serve",
                "--root",
                str(root),
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--metrics-port",
                "0",
                "--metrics-port-file",
                str(metrics_file),
                *(("--host", host) if host is not None else ()),
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        port = int(_wait_for_file(port_file, proc, deadline, log_path))
        metrics_port = int(_wait_for_file(metrics_file, proc, deadline, log_path))
        address = f"{host or '127.0.0.1'}:{port}"
        channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="checkpointd.v1.CheckpointService"),
                timeout=max(1.0, deadline - time.monotonic()),
                wait_for_ready=True,
            )
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"daemon health is {reply.status}")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return Daemon(proc, root, port, metrics_port, log_path, credentials, host or "127.0.0.1")


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Polls `condition` with a deadline, for what has no event to wait on.

    The daemon's state (a save queued, a lane freed) and threads ending give
    no signal a test can block on; a hang fails with `what` instead.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)  # polling a result, with a deadline
