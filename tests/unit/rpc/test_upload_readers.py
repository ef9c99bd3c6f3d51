"""checkpointd.rpc.upload's reader threads: a save's receive runs on a kept thread, reused by the next save."""

from __future__ import annotations

import threading
import time

import pytest

from checkpointd.protocol.errors import DeadlineError
from checkpointd.rpc import upload

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
