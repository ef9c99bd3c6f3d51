"""Received RestoreFiles chunks written into a private dir's files, on a thread of their own.

The stream's chunks are memoryviews into the messages gRPC received; each is
written with one pwrite (no copy in Python) into its file, made at its final
size first (sparse), while the receiving thread takes the next chunk.
"""

from __future__ import annotations

import os
import queue
import threading

# Received chunks waiting for their write (each at most the daemon's
# FILE_CHUNK_BYTES): enough to overlap the writes with the stream.
WRITES_QUEUED = 4


class Writer:
    """Writes received chunks into files under a dir, each file made at its final size (sparse).

    The writes run on a thread of the writer's own, up to `WRITES_QUEUED`
    chunks behind, so the next chunk is taken off the stream while the last
    one lands in the file; `close` waits for them and raises the first error.

    Args:
        directory: the dir the files' paths are relative to.
        sizes: each file's size, by path.
    """

    def __init__(self, directory: str, sizes: dict[str, int]) -> None:
        self._dir = directory
        self._sizes = sizes
        self._fds: dict[str, int] = {}
        self._queue: queue.Queue[tuple[str, int, memoryview | bytes] | None] = queue.Queue(WRITES_QUEUED)
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None

    def __call__(self, path: str, offset: int, data: memoryview | bytes) -> None:
        if self._error is not None:
            self.close()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpointd-restore-write", daemon=True)
            self._thread.start()
        self._queue.put((path, offset, data))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._write(*item)
                except Exception as e:  # raised by the next call or close; the thread keeps draining
                    self._error = e

    def _write(self, path: str, offset: int, data: memoryview | bytes) -> None:
        fd = self._fds.get(path)
        if fd is None:
            full = os.path.join(self._dir, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            fd = self._fds[path] = os.open(full, os.O_WRONLY | os.O_CREAT, 0o600)
            os.ftruncate(fd, self._sizes[path])
        os.pwrite(fd, data, offset)

    def close(self) -> None:
        """Waits for the queued writes and closes the files.

        Raises:
            OSError: a write failed (the files are closed all the same).
            KeyError: a chunk of a file the writer was given no size for.
        """
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def abandon(self) -> None:
        """Closes after a failure: waits for the queued writes, and keeps quiet about theirs."""
        try:
            self.close()
        except (OSError, KeyError):
            pass
