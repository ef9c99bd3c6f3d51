"""The ops commands against endpoints that are not a healthy daemon: exit codes and messages.

Each endpoint is in-process on 127.0.0.1 port 0: a socket that accepts and
never answers, a gRPC server without checkpointd's service, and gRPC
servers that answer every call with one status. Exit codes: 1 only when the
daemon answered that saves were still in flight; 2 when the command could
not do its job, with a message that names the fix.
"""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

from checkpointd.cli import ops
from checkpointd.cli.parse import STATUS_TIMEOUT, OpsCommand, config_from_args
from checkpointd.core.config import ServeConfig
from checkpointd.protocol import credentials
from checkpointd.protocol.address import DEFAULT_PORT, with_default_port

LIMIT = 20.0  # any call in this file; reached only when a test fails


def run(command: OpsCommand, environ: dict[str, str] | None = None) -> tuple[int, str, float]:
    """Runs the command in-process: exit code, stderr, seconds taken."""
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    code = ops.run(command, out, err, environ={} if environ is None else environ)
    return code, err.getvalue(), time.monotonic() - started


@pytest.fixture
def silent() -> Iterator[str]:
    """The address of a socket that accepts connections and never says a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(LIMIT)
        for conn in held:
            conn.close()
        listener.close()


@pytest.fixture
def answering() -> Iterator[Callable[..., str]]:
    """Starts gRPC servers that answer every call with one status (None: no service at all)."""
    servers: list[grpc.Server] = []

    def start(code: grpc.StatusCode | None = None, details: str = "") -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        if code is not None:

            def abort(request: bytes, context: grpc.ServicerContext) -> None:
                context.abort(code, details)

            class Everything(grpc.GenericRpcHandler):
                def service(self, details_: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
                    return grpc.unary_unary_rpc_method_handler(abort)

            server.add_generic_rpc_handlers((Everything(),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None).wait(LIMIT)


def command(name: str, address: str, timeout: float | None = None, run: str | None = None) -> OpsCommand:
    if name == "close":
        run = run or "r"
    return OpsCommand(name, address, run, timeout)


# Silent endpoints: --timeout is the limit, and no answer is exit 2.


@pytest.mark.parametrize("name", ["flush", "close", "status"])
def test_a_silent_endpoint_is_exit_2_within_the_timeout(silent: str, name: str) -> None:
    code, err, seconds = run(command(name, silent, timeout=1.0))
    assert code == 2, err
    assert f"no answer from {silent} within 1s (--timeout)" in err
    assert "is a checkpointd daemon listening there" in err
    assert "Traceback" not in err and "DeadlineError" not in err
    assert seconds < 1.0 + ops.ANSWER_SLACK + 1.0  # --timeout, its slack, and start-up


def test_status_waits_its_documented_default_and_says_so_in_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    command_, _ = config_from_args(["status"])
    assert isinstance(command_, OpsCommand) and command_.timeout == STATUS_TIMEOUT == 30.0
    with pytest.raises(SystemExit):
        config_from_args(["status", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"(default: {STATUS_TIMEOUT:g})" in help_text
    assert "no limit" not in help_text


@pytest.mark.parametrize("name", ["flush", "close"])
def test_flush_and_close_help_say_what_each_exit_means(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        config_from_args([name, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "exit 1 if some are still in flight then, exit 2 if no daemon answered within it (default: no limit)"
        in help_text
    )


# Endpoints that answer, but not as a daemon that can do the job.


@pytest.mark.parametrize("name", ["flush", "close", "status"])
def test_an_address_that_does_not_serve_checkpointd_says_so_exit_2(answering, name: str) -> None:  # noqa: ANN001
    address = answering()  # a gRPC server without the service: UNIMPLEMENTED, as an HTTP 404 is
    code, err, _ = run(command(name, address, timeout=5.0))
    assert code == 2, err
    assert f"the address {address} does not serve checkpointd" in err
    assert "--address HOST:PORT" in err


def test_nothing_listening_is_cannot_reach_exit_2() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    code, err, _ = run(command("status", address))
    assert code == 2
    assert f"cannot reach a daemon at {address}" in err


def test_a_call_without_a_token_points_to_token_file_and_the_environment(answering) -> None:  # noqa: ANN001
    address = answering(grpc.StatusCode.UNAUTHENTICATED, "missing credentials")
    code, err, _ = run(command("status", address))
    assert code == 2
    assert "wants a bearer token and none was given: give it with --token-file FILE or the CHECKPOINTD_TOKEN" in err
    code, err, _ = run(command("status", address), environ={"CHECKPOINTD_TOKEN": "wrong"})
    assert code == 2
    assert "refused the token from CHECKPOINTD_TOKEN" in err


def test_an_unknown_run_is_exit_2_with_the_daemons_words(answering) -> None:  # noqa: ANN001
    words = "no run named 'nope' is open on this daemon; open runs: a, b"
    address = answering(grpc.StatusCode.NOT_FOUND, words)
    for name in ("flush", "close", "status"):
        code, err, _ = run(command(name, address, run="nope"))
        assert code == 2, name
        assert f"RunNotFoundError: {words}" in err
        assert "register it first" not in err


def test_the_daemons_still_in_flight_is_exit_1(answering) -> None:  # noqa: ANN001
    words = "flush timed out after 5s; saves still in flight for runs: r"
    address = answering(grpc.StatusCode.DEADLINE_EXCEEDED, words)
    code, err, seconds = run(command("flush", address, timeout=5.0))
    assert code == 1
    assert f"DeadlineError: {words}" in err
    assert seconds < 5.0  # the fake answers at once; it is its answer, not our deadline


@pytest.mark.parametrize(
    ("address", "dialled"),
    [
        ("localhost", "localhost:7431"),
        ("ckpt-host", "ckpt-host:7431"),
        ("ckpt-host:9000", "ckpt-host:9000"),
        ("10.0.0.5", "10.0.0.5:7431"),
        ("[::1]", "[::1]:7431"),
        ("[::1]:9000", "[::1]:9000"),
        ("::1", "[::1]:7431"),
        ("unix:/run/checkpointd.sock", "unix:/run/checkpointd.sock"),
        ("dns:///ckpt-host:9000", "dns:///ckpt-host:9000"),
    ],
)
def test_an_address_without_a_port_dials_the_daemons_default_port(
    address: str, dialled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # gRPC alone would dial 443 for "localhost", where no daemon listens.
    targets: list[str] = []
    real = grpc.insecure_channel
    monkeypatch.setattr(grpc, "insecure_channel", lambda target, **kw: targets.append(target) or real(target, **kw))
    credentials.open_channel(address).close()
    assert targets == [dialled]
    assert with_default_port(address) == dialled
    assert DEFAULT_PORT == ServeConfig().port == 7431  # one definition, both sides
