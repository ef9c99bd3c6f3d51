"""checkpointd.rpc.upload's reader threads: a save's receive runs on a kept thread, reused by the next save."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import crc32c
import pytest

from checkpointd.protocol.errors import DeadlineError
from checkpointd.rpc import upload
from checkpointd.v1 import checkpointd_pb2 as pb

DEADLINE = 30.0  # any single wait here; reached only on failure


def _on_thread(_requests: object) -> int:
    return threading.get_ident()


def _same(received: object) -> object:
    return received


def _wait_for(condition: object, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {DEADLINE}s")
        time.sleep(0.01)  # polling a condition with a deadline


def test_saves_one_after_another_reuse_one_reader_thread() -> None:
    readers = upload._Readers()
    ran: list[int] = []
    done = threading.Event()

    def task() -> None:
        ran.append(threading.get_ident())
        done.set()

    for _ in range(5):
        done.clear()
        readers.run(task)
        assert done.wait(DEADLINE)
        # The thread marks itself idle once its task has returned.
        _wait_for(lambda: readers._idle == 1, "the reader idle again")
    assert len(ran) == 5
    assert len(set(ran)) == 1


def test_saves_at_once_each_get_a_thread_and_idle_ones_beyond_keep_end() -> None:
    readers = upload._Readers(keep=1)
    release = threading.Event()
    started = threading.Barrier(4, timeout=DEADLINE)
    ran: list[int] = []

    def task() -> None:
        ran.append(threading.get_ident())
        started.wait()  # all three run together: three threads
        release.wait(DEADLINE)

    for _ in range(3):
        readers.run(task)
    started.wait()
    assert len(set(ran)) == 3
    release.set()
    _wait_for(lambda: readers._idle == 1, "one reader kept idle")
    _wait_for(
        lambda: sum(t.name.startswith("upload-reader") and t.ident in ran for t in threading.enumerate()) == 1,
        "the readers beyond `keep` ended",
    )


def test_within_reports_the_result_and_the_deadline_on_kept_threads() -> None:
    first = upload.within(_on_thread, iter(()), time.monotonic() + DEADLINE, DEADLINE, _same)
    second = upload.within(_on_thread, iter(()), time.monotonic() + DEADLINE, DEADLINE, _same)
    assert first == second  # the second save's receive ran on the first's thread

    release = threading.Event()

    def stalled(_requests: object) -> None:
        release.wait(DEADLINE)

    with pytest.raises(DeadlineError, match="--upload-timeout"):
        upload.within(stalled, iter(()), time.monotonic() + 0.05, 0.05, _same)
    release.set()


class _Written:
    """A sink that counts the bytes written into it."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, part: int, offset: int, data: object, crc: int | None = None) -> None:
        self.bytes += memoryview(data).nbytes  # type: ignore[arg-type]


class _Active:
    def is_active(self) -> bool:
        return True


def test_a_large_upload_read_ahead_that_stalls_is_cut_off_and_its_threads_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    readers = upload._Readers()
    monkeypatch.setattr(upload, "_READERS", readers)  # its own threads: the reader's and the taker's
    monkeypatch.setattr(upload, "READ_AHEAD_FROM", 0)  # chunks taken ahead, as for a large snapshot
    chunk, total = 1 << 10, 8 << 10
    data = bytes(range(256)) * (total // 256)
    release = threading.Event()

    def stalled_client() -> Iterator[pb.SaveRequest]:
        for offset in range(0, 2 * chunk, chunk):  # two chunks, then the client stalls
            piece = data[offset : offset + chunk]
            yield pb.SaveRequest(chunk=pb.Chunk(offset=offset, data=piece, crc32c=crc32c.crc32c(piece)))
        release.wait(DEADLINE)
        late = data[2 * chunk : 3 * chunk]  # a good chunk: only the deadline keeps it out
        yield pb.SaveRequest(chunk=pb.Chunk(offset=2 * chunk, data=late, crc32c=crc32c.crc32c(late)))

    sink = _Written()
    with pytest.raises(DeadlineError, match="--upload-timeout"):
        upload.within(
            lambda requests: upload.receive_snapshot(requests, total, _Active(), [total], None, sink),
            stalled_client(),
            time.monotonic() + 0.2,
            0.2,
            _same,
        )
    release.set()  # the client sends again, past the deadline: the save was given up
    _wait_for(lambda: readers._idle == 2, "the reader and the taker both back to idle")
    assert sink.bytes <= 2 * chunk  # the chunk sent after the deadline was not written
