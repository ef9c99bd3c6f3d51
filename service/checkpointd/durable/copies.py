"""Copying a byte range from one file into another in the kernel: `copy_file_range(2)`.

An incremental save's unchanged ranges go from the base save's data file
into the new one without passing through the daemon's memory. Where the
file system can share extents (Btrfs, XFS with reflink, OCFS2, NFS 4.2,
CIFS), Linux's copy_file_range clones them itself when the ranges allow
(block-aligned offsets on both sides), so no FICLONERANGE call is made here;
on ext4, tmpfs and overlayfs it copies the bytes in the kernel. A bundle's
tensors start anywhere, not on a block, but a range copied from a base of
the same layout sits at the same offset modulo the block on both sides: it
is copied as its unaligned head and tail and its block-aligned middle, which
a reflinking file system then shares instead of copying (on XFS with reflink,
a GiB in milliseconds, where unaligned it copies the bytes). Where the
call is refused (another file system on each side on old kernels, a seccomp
filter), the range is copied with pread/pwrite.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import tempfile
from pathlib import Path

# Refusals that mean "not here", after which the bytes are copied by hand.
_UNSUPPORTED = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM})
_PIECE = 1 << 20
_BLOCK = 4096  # the file systems' block (and clone) granularity


def copy_range(src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int) -> None:
    """Copies `nbytes` at `src_offset` of descriptor `src` to `dst_offset` of `dst`.

    Raises:
        OSError: the copy failed, or `src` ends before the range does (EIO).
    """
    head = -src_offset % _BLOCK
    if src_offset % _BLOCK == dst_offset % _BLOCK and nbytes >= head + _BLOCK:
        middle = (nbytes - head) // _BLOCK * _BLOCK  # block-aligned on both sides: a clone where it can be
        for at, n in ((0, head), (head, middle), (head + middle, nbytes - head - middle)):
            if n:
                _copy(src, src_offset + at, dst, dst_offset + at, n)
        return
    _copy(src, src_offset, dst, dst_offset, nbytes)


def _copy(src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int) -> None:
    while nbytes:
        try:
            n = os.copy_file_range(src, dst, nbytes, src_offset, dst_offset)
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
            _copy_by_hand(src, src_offset, dst, dst_offset, nbytes)
            return
        if n == 0:
            raise OSError(errno.EIO, f"the source file ends {nbytes} bytes before the range to copy does")
        src_offset, dst_offset, nbytes = src_offset + n, dst_offset + n, nbytes - n


def _copy_by_hand(src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int) -> None:
    while nbytes:
        data = os.pread(src, min(nbytes, _PIECE), src_offset)
        if not data:
            raise OSError(errno.EIO, f"the source file ends {nbytes} bytes before the range to copy does")
        view = memoryview(data)
        at = dst_offset
        while view:
            view = view[os.pwrite(dst, view, at) :]
            at = dst_offset + len(data) - len(view)
        src_offset, dst_offset, nbytes = src_offset + len(data), dst_offset + len(data), nbytes - len(data)


_FICLONERANGE = 0x4020940D  # _IOW(0x94, 13, struct file_clone_range)


def shares_extents(directory: Path) -> bool:
    """Whether the file system of `directory` clones a file's blocks into another (reflink), probed once.

    Two unnamed files (O_TMPFILE, or named ones unlinked at once where that
    is refused) in `directory`: a block written to one, cloned into the
    other with FICLONERANGE. XFS with reflink and Btrfs share it; ext4,
    tmpfs and overlayfs refuse. Nothing is left behind.
    """
    made: list[int] = []
    try:
        for _ in range(2):
            made.append(_unnamed_file(directory))
        src, dst = made
        os.pwrite(src, b"\0" * _BLOCK, 0)
        fcntl.ioctl(dst, _FICLONERANGE, struct.pack("=qQQQ", src, 0, _BLOCK, 0))
        return True
    except OSError:
        return False
    finally:
        for fd in made:
            os.close(fd)


def _unnamed_file(directory: Path) -> int:
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno not in _UNSUPPORTED and e.errno != errno.EISDIR:
            raise
    fd, name = tempfile.mkstemp(prefix=".checkpointd-probe-", dir=directory)
    os.unlink(name)
    return fd
