"""A staged RestoreFiles: the asked ranges landed in files on the daemon's host, for a client there.

A trainer that moved to another node talks to the daemon on its new node:
the same host. Streaming the bytes to it over gRPC costs a message per
chunk, a CRC32C on each side and a write on the client; instead the daemon
writes the ranges (ranged GETs on an object store) straight into files in
its staging dir (its shared-memory folder on a tmpfs, only its user may
open it), checks each file asked whole against its manifest's CRC32C as
the pieces land, and names the dir. The client hard-links the files into a
dir of its own (a copy where it may not link) and ends the call; the
daemon then deletes its names (the client's links keep the bytes as long
as it needs them). The daemon's names also go when the client goes away,
after `HOLD_SECONDS`, or when the daemon stops (the whole folder, also
swept by the next daemon if this one was killed).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from checkpointd.core.ports import StagesFiles, Store
from checkpointd.protocol import wire
from checkpointd.protocol.errors import ChecksumError, LimitExceededError, SaveFailedError
from checkpointd.restores.files import FilePlan, pieces

_LOGGER = logging.getLogger(__name__)

PREFIX = "restore-"
HOLD_SECONDS = 60.0
"""How long staged files wait for their client to take them and end the call."""


@dataclass(frozen=True)
class StagedFiles:
    """Where a plan's ranges were staged.

    Attributes:
        dir: the staging dir of this call.
        paths: the files written, relative to it (as the plan's files name them).
        nbytes: the bytes staged.
    """

    dir: Path
    paths: tuple[str, ...]
    nbytes: int


@contextlib.contextmanager
def staged(store: Store, plan: FilePlan, root: Path) -> Iterator[StagedFiles]:
    """Writes the plan's ranges into files in a new dir under `root`; deletes the dir when the block ends.

    Each file is made at its full size; only the asked ranges are written
    (the rest are holes, which hold no memory and read as zeros).

    Raises:
        ChecksumError: a file asked whole does not match its manifest's CRC32C.
        LimitExceededError: the staging dir has no room for the ranges.
        SaveFailedError, UnavailableError: the store could not read them.
    """
    directory = root / f"{PREFIX}{secrets.token_hex(8)}"
    directory.mkdir(mode=0o700)
    try:
        paths = tuple(dict.fromkeys(path for path, _, _ in plan.ranges))
        fds: dict[str, int] = {}
        try:
            _open(plan, directory, paths, fds)
            _write(store, plan, fds)
        except OSError as e:
            # Written with pwrite, never mapped: a full tmpfs is an error here, not a SIGBUS.
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise LimitExceededError(
                f"RestoreFiles: no room in the staging dir {root} for {plan.payload_bytes} bytes of "
                f"{plan.save.export_dir!r}; restore without staging (the bytes sent), or free memory on that tmpfs"
            ) from None
        finally:
            for fd in fds.values():
                os.close(fd)
        yield StagedFiles(directory, paths, plan.payload_bytes)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _open(plan: FilePlan, directory: Path, paths: tuple[str, ...], fds: dict[str, int]) -> None:
    """Makes each file at its size (a sparse file: its pages come as the ranges are written)."""
    sizes = {f.path: f.size for f in plan.files}
    for path in paths:
        full = directory / path
        full.parent.mkdir(parents=True, exist_ok=True)
        fds[path] = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fds[path], sizes[path])


def _write(store: Store, plan: FilePlan, fds: Mapping[str, int]) -> None:
    """Writes the ranges, checking each file asked whole against its manifest's CRC32C once it has landed."""
    written = (
        store.stage_ranges(plan.save, plan.ranges, fds)
        if isinstance(store, StagesFiles)
        else _pwritten(store, plan, fds)
    )
    files = {f.path: f for f in plan.files}
    with contextlib.closing(written):
        for path, offset, length in plan.ranges:
            staged = next(written, None)
            if staged is None or staged[:3] != (path, offset, length):
                raise SaveFailedError(f"RestoreFiles: the store staged {staged!r}, not {(path, offset, length)!r}")
            value, file = staged[3], files[path]
            if offset == 0 and length == file.size and value != file.crc32c:
                raise ChecksumError(
                    f"{plan.save.export_dir!r}: {path} does not match its manifest's CRC32C ({value:08x}, "
                    f"{file.crc32c:08x} committed): the stored file is corrupt or was replaced; nothing was restored"
                )


def _pwritten(store: Store, plan: FilePlan, fds: Mapping[str, int]) -> Generator[tuple[str, int, int, int], None, None]:
    """A store without staging of its own: its pieces (pread, GETs) written one by one, each range's CRC32C folded."""
    written = pieces(store, plan)
    for path, offset, length in plan.ranges:
        at, value = offset, 0
        while at < offset + length:
            piece = next(written)
            view, done = memoryview(piece.data), 0
            while done < len(view):
                done += os.pwrite(fds[path], view[done:], at + done)
            value = wire.crc32c_of(piece.data, value)
            at += len(view)
        yield path, offset, length, value


def log_staged(run: str, plan: FilePlan, staged_files: StagedFiles, seconds: float) -> None:
    """Logs a staged RestoreFiles call, once its client has taken the files."""
    save = plan.save
    _LOGGER.info(
        "staged files run=%s kind=%s export_dir=%s step=%d bytes=%d in %s, taken after %.3fs",
        run, save.kind.value, save.export_dir, save.step, staged_files.nbytes, staged_files.dir, seconds,
    )  # fmt: skip
