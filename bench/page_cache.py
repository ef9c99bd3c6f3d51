"""A file's pages in the page cache: dropped for a cold read, and counted to check they went.

`drop(paths)` fsyncs each file (only clean pages can be dropped) and asks the
kernel to drop its cached pages with `posix_fadvise(POSIX_FADV_DONTNEED)`:
per file, no root needed (unlike `echo 1 > /proc/sys/vm/drop_caches`), and
nothing else on the machine loses its cache. `resident(paths)` counts the
files' pages the cache holds, with mincore(2) over a read-only mapping (what
vmtouch does), so a cold row can say how cold its files were.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

_PROT_READ = 1
_MAP_SHARED = 1
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


def drop(paths: Iterable[Path | str]) -> None:
    """Writes each file's dirty pages, then drops its pages from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # DONTNEED skips dirty pages
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(paths: Iterable[Path | str]) -> tuple[int, int]:
    """(pages in the page cache, pages) over the files, as mincore(2) reports them."""
    libc = _libc()
    cached = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if not size:
            continue
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                vec = ctypes.create_string_buffer(pages)
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                cached += sum(b & 1 for b in vec.raw)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        total += pages
    return cached, total
