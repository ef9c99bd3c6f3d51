"""checkpointd.rpc.read_ahead: a stream taken a few messages ahead of its consumer, by a thread that stops with it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from checkpointd.protocol.errors import DeadlineError
from checkpointd.rpc.read_ahead import read_ahead

DEADLINE = 30.0  # any single wait here; reached only on failure


class _Counted:
    """An endless stream that counts the messages taken from it."""

    def __init__(self) -> None:
        self.taken = 0

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> int:
        self.taken += 1
        return self.taken - 1


class _Threads:
    """A `run` that starts each taker on a thread it keeps, to join."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def __call__(self, task: Callable[[], None]) -> None:
        thread = threading.Thread(target=task, daemon=True)
        self.threads.append(thread)
        thread.start()

    def joined(self) -> bool:
        for thread in self.threads:
            thread.join(DEADLINE)
        return not any(t.is_alive() for t in self.threads)


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {DEADLINE}s")
        time.sleep(0.01)  # polling a condition with a deadline


@pytest.mark.parametrize("depth", [1, 3, 16])
def test_every_message_comes_in_order_then_the_stream_ends(depth: int) -> None:
    threads = _Threads()
    assert list(read_ahead(iter(range(50)), depth, threads)) == list(range(50))
    assert list(read_ahead(iter([]), depth, threads)) == []
    assert threads.joined()


def test_the_streams_error_is_raised_after_what_came_before_it() -> None:
    def stream() -> Iterator[str]:
        yield "a"
        yield "b"
        raise DeadlineError("the client went away")

    got: list[str] = []
    with pytest.raises(DeadlineError, match="went away"):
        for message in read_ahead(stream(), 4):
            got.append(message)
    assert got == ["a", "b"]


@pytest.mark.parametrize("depth", [1, 3])
def test_it_takes_at_most_depth_ahead_and_its_thread_ends_once_the_consumer_stops(depth: int) -> None:
    threads = _Threads()
    stream = _Counted()
    messages = read_ahead(stream, depth, threads)
    assert next(messages) == 0
    # Taken: the one consumed, `depth` queued, and one more held by the taker blocked on the full queue.
    _wait_for(lambda: stream.taken == depth + 2, f"{depth + 2} messages taken")
    messages.close()  # the consumer stops (an error in the receive, or the save given up)
    assert threads.joined()
    assert stream.taken == depth + 3  # the one it was putting went in; the next one it took, it dropped
