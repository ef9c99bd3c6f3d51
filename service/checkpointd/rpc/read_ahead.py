"""A gRPC message stream taken up to a few messages ahead of its consumer, by a thread of its own.

gRPC Python hands over a stream's next message only when it is asked for
it, so a consumer that checks and writes each chunk before asking for the
next leaves the connection idle meanwhile. The CRC32C and the write release
the GIL, so a thread taking the next messages from gRPC runs beside them:
the daemon reads a large Save's chunks so (bench/README.md, "Figures behind
choices in the code").
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

_T = TypeVar("_T")


def _on_a_thread(task: Callable[[], None]) -> None:
    threading.Thread(target=task, name="read-ahead", daemon=True).start()


def read_ahead(
    items: Iterator[_T], depth: int, run: Callable[[Callable[[], None]], None] = _on_a_thread
) -> Iterator[_T]:
    """`items`, taken from their iterator up to `depth` ahead by a task that `run` starts.

    `run` runs the taker (default: a daemon thread of its own; the daemon
    passes its reader pool's). What the iterator raises is raised here, in
    order, after the items before it. Once the consumer stops (an error, or
    this generator closed) the taker stops at its next item, never blocked
    on the queue.
    """
    ahead: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=depth)
    stopped = threading.Event()

    def take() -> None:
        end: tuple[bool, Any] = (False, None)
        try:
            for item in items:
                if stopped.is_set():
                    return
                ahead.put((True, item))  # after `stopped`, at most this one put: the consumer drained
        except BaseException as exc:  # noqa: BLE001 - raised in the consumer
            end = (False, exc)
        if not stopped.is_set():
            ahead.put(end)

    run(take)
    try:
        while True:
            more, item = ahead.get()
            if not more:
                if item is not None:
                    raise item
                return
            yield item
    finally:
        stopped.set()
        while True:  # frees a taker blocked on a full queue; it then sees `stopped`
            try:
                ahead.get_nowait()
            except queue.Empty:
                break
