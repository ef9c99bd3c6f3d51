"""The client's session against fake servers in-process: the lease-wait sentence, and errors that name the address.

- A RegisterRun that waits for another daemon's lease: the daemon's
  `checkpointd-lease-wait` initial metadata is logged once at INFO while the
  call still waits, not after it is answered.
- An address that is not a checkpointd gRPC port: an HTTP/1 server (what the
  daemon's --metrics-port is) is named as such, found by a probe and not by
  gRPC's message text; an address where nothing listens is named in the error.
"""

from __future__ import annotations

import http.server
import logging
import socket
import threading
from collections.abc import Iterator
from concurrent import futures

import pytest

from checkpointd.protocol.errors import UnavailableError
from checkpointd.protocol.kinds import SaveKind, to_wire
from checkpointd.protocol.names import LEASE_WAIT_METADATA
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client.transport.connection import ConnectionOptions
from checkpointd_client.transport.session import DaemonSession
from tests.component.serving import serving

WAIT = 10.0  # seconds; every wait here is bounded by it
SENTENCE = "run 'r' is held by host node-a pid 4242, renewed 3.0 s ago; waiting up to 30 s for its lease"


class _LeaseWaitingDaemon(checkpointd_pb2_grpc.CheckpointServiceServicer):
    """Sends the lease-wait metadata at once, then answers RegisterRun only once `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def RegisterRun(self, request_iterator, context):  # noqa: N802 - the generated name
        header = next(request_iterator).header
        context.send_initial_metadata(((LEASE_WAIT_METADATA, SENTENCE),))
        assert self.release.wait(WAIT)
        return pb.RegisterRunResponse(run=header.run)


class _Records(logging.Handler):
    """Keeps records; `seen` is set by the first whose message holds `needle`."""

    def __init__(self, needle: str) -> None:
        super().__init__(logging.DEBUG)
        self.needle = needle
        self.records: list[logging.LogRecord] = []
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if self.needle in record.getMessage():
            self.seen.set()


@pytest.fixture
def records() -> Iterator[_Records]:
    handler = _Records(SENTENCE)
    logger = logging.getLogger("checkpointd_client")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@pytest.fixture
def lease_waiting() -> Iterator[tuple[_LeaseWaitingDaemon, str]]:
    fake = _LeaseWaitingDaemon()
    with serving(fake) as address:
        try:
            yield fake, address
        finally:
            fake.release.set()


def _session(address: str) -> DaemonSession:
    return DaemonSession(address, "r", ConnectionOptions(timeout=WAIT), owner="checkpointer", upload_threads=1)


def _register(session: DaemonSession) -> pb.RegisterRunResponse:
    header = pb.RegisterRunHeader(run="r", kind=to_wire(SaveKind.TRAINING_CHECKPOINT))
    return session.register_run(iter([pb.RegisterRunRequest(header=header)]), "registering run 'r'")


def test_the_lease_wait_is_logged_once_at_info_while_the_registration_still_waits(
    lease_waiting: tuple[_LeaseWaitingDaemon, str], records: _Records
) -> None:
    fake, address = lease_waiting
    session = _session(address)
    answered: futures.Future[pb.RegisterRunResponse] = futures.Future()
    caller = threading.Thread(target=lambda: answered.set_result(_register(session)))
    try:
        caller.start()
        assert records.seen.wait(WAIT), "the lease-wait sentence was not logged while the call waited"
        assert not answered.done()  # logged before the daemon answered
        fake.release.set()
        assert answered.result(WAIT).run == "r"
    finally:
        fake.release.set()
        caller.join(WAIT)
        session.shutdown()
    said = [r for r in records.records if SENTENCE in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert address in said[0].getMessage() and "run r" in said[0].getMessage()


@pytest.fixture
def http1_port() -> Iterator[int]:
    """An HTTP/1 server, as the daemon's --metrics-port is."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(WAIT)


def test_an_http1_server_at_the_address_is_named_as_not_the_grpc_port(http1_port: int) -> None:
    address = f"127.0.0.1:{http1_port}"
    session = _session(address)
    try:
        with pytest.raises(UnavailableError) as raised:
            _register(session)
    finally:
        session.shutdown()
    message = str(raised.value)
    assert f"registering run 'r' at {address}" in message
    assert "not checkpointd's gRPC port" in message and "--metrics-port" in message


def test_an_address_where_nothing_listens_is_named_without_an_http_hint() -> None:
    with socket.socket() as s:  # a port that was free a moment ago, now closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    session = _session(address)
    try:
        with pytest.raises(UnavailableError) as raised:
            _register(session)
    finally:
        session.shutdown()
    assert f"at {address}" in str(raised.value) and "HTTP/1" not in str(raised.value)
