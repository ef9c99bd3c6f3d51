"""A FUSE filesystem for the tests: BACKING passed through at MOUNT, fsync failing EIO while FLAG exists.

Run as `python -m tests.integration.support.eio_fs BACKING MOUNT FLAG` (in the
foreground; SIGTERM unmounts). It needs fusepy (`import fuse`, ctypes over
libfuse 2) and /dev/fuse; `tests/integration/faults/test_faults.py` skips without them.
The disk fault it stands for is a device that fails its writeback: every
write lands, the fsync (file or directory) that should make it durable says EIO.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

from fuse import FUSE, FuseOSError, Operations  # type: ignore[import-not-found]

_STAT = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid")
_STATVFS = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag", "f_frsize")


class EioFs(Operations):  # type: ignore[misc]
    """Every call passed to the backing dir's; fsync and fsyncdir fail EIO while the flag file exists."""

    def __init__(self, backing: str, flag: str) -> None:
        self.backing, self.flag = backing, flag

    def _path(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def __call__(self, op: str, path: str, *args: Any) -> Any:
        try:
            return super().__call__(op, path, *args)
        except OSError as e:
            if isinstance(e, FuseOSError):
                raise
            raise FuseOSError(e.errno or errno.EIO) from e

    def _failing(self) -> bool:
        return os.path.exists(self.flag)

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.lstat(self._path(path))
        return {k: getattr(st, k) for k in _STAT}

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._path(path))]

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(self._path(path), mode)

    def rmdir(self, path: str) -> None:
        os.rmdir(self._path(path))

    def unlink(self, path: str) -> None:
        os.unlink(self._path(path))

    def rename(self, old: str, new: str) -> None:
        os.rename(self._path(old), self._path(new))

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self._path(path), mode)

    def chown(self, path: str, uid: int, gid: int) -> None:
        os.chown(self._path(path), uid, gid)

    def utimens(self, path: str, times: tuple[float, float] | None = None) -> None:
        os.utime(self._path(path), times)

    def truncate(self, path: str, length: int, fh: int | None = None) -> None:
        os.truncate(self._path(path), length)

    def symlink(self, target: str, source: str) -> None:
        os.symlink(source, self._path(target))

    def readlink(self, path: str) -> str:
        return os.readlink(self._path(path))

    def statfs(self, path: str) -> dict[str, Any]:
        st = os.statvfs(self._path(path))
        return {k: getattr(st, k) for k in _STATVFS}

    def open(self, path: str, flags: int) -> int:
        return os.open(self._path(path), flags)

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return os.open(self._path(path), os.O_WRONLY | os.O_CREAT, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        return os.pwrite(fh, data, offset)

    def flush(self, path: str, fh: int) -> None:
        return None

    def release(self, path: str, fh: int) -> None:
        os.close(fh)

    def fsync(self, path: str, datasync: int, fh: int) -> None:
        if self._failing():
            raise FuseOSError(errno.EIO)
        os.fsync(fh)

    def fsyncdir(self, path: str, datasync: int, fh: int) -> None:
        if self._failing():
            raise FuseOSError(errno.EIO)


if __name__ == "__main__":
    backing, mount, flag = sys.argv[1:4]
    FUSE(EioFs(backing, flag), mount, foreground=True, allow_other=True)
