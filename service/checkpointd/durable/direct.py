"""Writing a file from an aligned image in memory with O_DIRECT, past the page cache.

A large buffered write first copies every byte into the page cache, then
the disk writes them back (durable.Writeback starts it early, the commit's
fsync waits for the rest); under load both lag. An O_DIRECT write hands the
disk the caller's own pages (a shared-memory segment holding the file's
image), with no copy and no dirty pages for the fsync to find. The kernel
takes it only where the memory address, the file offset and the length are
all multiples of the device's block size: `ALIGNMENT` (a page) covers every
common one, so the image is the file laid out from a page-aligned address
and written in whole blocks, and the file is cut to its size after.

Where the file system refuses O_DIRECT (EINVAL at the open or the first
write: some FUSE and network file systems, older tmpfs), `write_image`
says so and the caller writes the bytes the ordinary way. The fsync before
publishing is still the caller's: O_DIRECT skips the page cache, not the
disk's own cache or the file's metadata. Stdlib only.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable

# The image's address, each write's file offset and length are multiples of this.
ALIGNMENT = 4096
# Bytes per write: the thread runs at the writers' low priority, and under
# load each wake-up after a write waits for the CPU while the disk idles, so
# few large writes; the kernel splits them for the device anyway.
PIECE_BYTES = 64 << 20

# os.open, for tests that stand in for a file system that refuses O_DIRECT.
Opener = Callable[[str, int], int]


def round_up(n: int, alignment: int = ALIGNMENT) -> int:
    """`n` rounded up to a multiple of `alignment`."""
    return -(-n // alignment) * alignment


def supported() -> bool:
    """Whether this platform has O_DIRECT at all (Linux, some BSDs)."""
    return hasattr(os, "O_DIRECT")


class DirectWrite:
    """Writes `image` into the existing file at `path` from offset 0 with O_DIRECT, on a thread of its own.

    `image` must start at an `ALIGNMENT`-aligned address (a page-aligned
    map, sliced at a multiple of it) and be a multiple of `ALIGNMENT` long;
    the caller cuts the file to its size afterwards. The writes release the
    GIL, so the caller may sum the bytes meanwhile; `wait()` ends it.
    """

    def __init__(self, path: str, image: memoryview, *, opener: Opener | None = None) -> None:
        if image.nbytes % ALIGNMENT:
            raise ValueError(f"an O_DIRECT image of {image.nbytes} bytes is not whole {ALIGNMENT}-byte blocks")
        self._path = path
        self._image = image
        self._opener = opener or (lambda p, flags: os.open(p, flags))
        self._refused = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="direct-write", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fd = -1
        try:
            try:
                fd = self._opener(self._path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._refused = True
                return
            view, at = self._image, 0
            while at < view.nbytes:
                piece = view[at : at + PIECE_BYTES]
                try:
                    n = os.pwrite(fd, piece, at)
                except OSError as e:
                    if e.errno == errno.EINVAL and at == 0:  # the file system opens it, but refuses the write
                        self._refused = True
                        return
                    raise
                if n <= 0 or n % ALIGNMENT:
                    raise OSError(errno.EIO, f"O_DIRECT write of {piece.nbytes} bytes at {at} wrote {n}")
                at += n
        except BaseException as e:  # noqa: BLE001 - raised again by wait()
            self._error = e
        finally:
            if fd >= 0:
                os.close(fd)

    def wait(self) -> bool:
        """Waits for the end of the write; False if the file system refused O_DIRECT (nothing written).

        Raises:
            OSError: a write failed (the file's content is unknown).
        """
        self._thread.join()
        if self._error is not None:
            raise self._error
        return not self._refused
