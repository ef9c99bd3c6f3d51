"""The client's one save call against a fake daemon in-process (no TensorFlow).

- An accepted non-blocking save's upload is counted from the accept until its
  call has ended on the upload thread, whatever the drop-in: a save that dials
  a fresh channel in an outage meanwhile leaves the old one open, and the
  upload ends durable.
- A skipped save copies nothing and counts no upload.
- The header a drop-in's payload makes is the one the daemon reads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from checkpointd.protocol import wire
from checkpointd.protocol.errors import UnavailableError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client.save_call import Decision, Payload, SaveCall, Upload
from checkpointd_client.ticket import SaveCounts, SaveTicket
from checkpointd_client.transport.connection import ConnectionOptions
from checkpointd_client.transport.session import DaemonSession
from tests.component.serving import serving

WAIT = 10.0  # seconds; every wait here is bounded by it
DATA = b"the snapshot's bytes"


class _Daemon(checkpointd_pb2_grpc.CheckpointServiceServicer):
    """Accepts every save unless `skip` is set; answers once the whole payload has arrived."""

    def __init__(self) -> None:
        self.skip = False
        self.headers: list[pb.SaveHeader] = []
        self.received: list[bytes] = []

    def Save(self, request_iterator, context):  # noqa: N802 - the generated name
        self.headers.append(next(request_iterator).header)
        if self.skip:
            yield pb.SaveResponse(decision=pb.SaveDecision(accepted=False, reason="another save is in flight"))
            return
        yield pb.SaveResponse(decision=pb.SaveDecision(accepted=True))
        data = b"".join(r.chunk.data for r in request_iterator)
        self.received.append(data)
        yield pb.SaveResponse(result=pb.SaveResult(path="/root/r/d", bytes_written=len(data)))


@pytest.fixture
def daemon() -> Iterator[tuple[_Daemon, str]]:
    fake = _Daemon()
    with serving(fake, workers=4) as address:
        yield fake, address


@pytest.fixture
def session(daemon: tuple[_Daemon, str]) -> Iterator[DaemonSession]:
    s = DaemonSession(daemon[1], "r", ConnectionOptions(timeout=WAIT), owner="checkpointer", upload_threads=1)
    try:
        yield s
    finally:
        s.shutdown()


def _call(session: DaemonSession, step: int) -> SaveCall:
    ticket = session.ticket(f"d/ckpt-{step}", SaveKind.TRAINING_CHECKPOINT, step)
    payload = Payload("d", len(DATA), training_checkpoint=pb.TrainingCheckpoint())
    return SaveCall(session, ticket, lambda: payload, shared_memory=False, incremental=False)


def test_an_upload_is_counted_until_its_call_ends_so_a_fresh_channel_leaves_it_open(
    daemon: tuple[_Daemon, str], session: DaemonSession
) -> None:
    fake, _ = daemon
    go = threading.Event()

    def held() -> Iterator[bytes]:
        assert go.wait(WAIT)
        yield from wire.save_request_chunks([DATA], 1024)

    call = _call(session, 1)
    session.begin()
    decision = call.decide(blocking=False)
    assert call.send(decision, blocking=False, copy=lambda _: Upload(held()))  # an upload thread took it
    assert session.uploading == 1 and not call.ticket.done()
    # An outage begins (a save the daemon could not take), and the next save dials a fresh channel.
    session.survive(SaveTicket("elsewhere", SaveKind.TRAINING_CHECKPOINT, 0, SaveCounts()), UnavailableError("x"))
    session.before_trying()
    go.set()
    result = call.ticket.result(WAIT)  # its channel was not closed under it
    assert result is not None and result.bytes_written == len(DATA)
    assert fake.received == [DATA]
    session.wait_idle(None, None)  # the upload thread released the save call
    assert session.uploading == 0 and session.busy == 0


def test_a_skipped_save_copies_nothing_and_counts_no_upload(
    daemon: tuple[_Daemon, str], session: DaemonSession
) -> None:
    fake, _ = daemon
    fake.skip = True
    copies: list[Decision] = []
    call = _call(session, 2)
    decision = call.decide(blocking=False)
    assert call.ticket.skipped and "in flight" in call.ticket.reason
    assert not call.send(decision, blocking=False, copy=lambda d: copies.append(d) or Upload([]))
    assert copies == [] and session.uploading == 0


def test_the_header_says_what_the_payload_and_the_ticket_say(
    daemon: tuple[_Daemon, str], session: DaemonSession
) -> None:
    fake, _ = daemon
    call = _call(session, 3)
    decision = call.decide(blocking=True)
    assert not call.send(decision, blocking=True, copy=lambda _: Upload(wire.save_request_chunks([DATA], 1024)))
    [header] = fake.headers
    assert (header.run, header.kind, header.export_dir, header.step, header.blocking) == (
        "r", pb.TRAINING_CHECKPOINT, "d", 3, True,
    )  # fmt: skip
    assert header.snapshot_bytes == len(DATA) and header.HasField("training_checkpoint")
    assert not header.shared_memory and not header.incremental and not header.on_notice
    assert call.ticket.result(0) is not None and session.uploading == 0
