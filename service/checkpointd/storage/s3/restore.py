"""Restore from the object store: a committed save's files, from its manifest.

RestoreFiles streams the asked byte ranges with parallel ranged GETs
(`read_ranges`): a few pieces in flight at once, each yielded in order as
soon as it and those before it have arrived, nothing staged on disk. A
client on the daemon's host has them landed in files instead
(`stage_ranges`): bigger GETs, each written where it goes as it arrives,
no message in between. The tensor Restore reads a local copy
(`local_copy`), each file checked against the manifest's size and CRC32C
before anything is yielded.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import secrets
import shutil
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import PurePosixPath

from checkpointd.core.ports import CommittedSave, SavedFile
from checkpointd.protocol import wire
from checkpointd.protocol.errors import ChecksumError, RunNotFoundError, SaveFailedError
from checkpointd.protocol.names import TMP_PREFIX
from checkpointd.protocol.wire import FILE_CHUNK_BYTES
from checkpointd.storage import save_manifest
from checkpointd.storage.s3.bucket import Bucket
from checkpointd.storage.s3.client import Progress
from checkpointd.storage.s3.keys import MANIFEST


@contextlib.contextmanager
def local_copy(
    bucket: Bucket, save: CommittedSave, progress: Callable[[int], None] | None = None
) -> Iterator[CommittedSave]:
    """Downloads a committed save into the store's staging dir, checks it against its manifest, yields it there.

    The copy is the save as the local store would hold it (a dir with its
    manifest, or a prefix's files in a dir); it is deleted when the block ends.

    Raises:
        RunNotFoundError: the save is no longer committed.
        ChecksumError: a file does not match its manifest's size or CRC32C.
        UnavailableError: the object store failed.
    """
    place = bucket.keys_of(save)
    files_base, manifest_key = place.files_base, place.manifest
    with bucket.reading(f"reading {save.path}"):
        document = bucket.manifest(manifest_key, None)
    if document is None:
        raise RunNotFoundError(f"the save {save.path} in {bucket.url} is no longer committed")
    bucket.staging_root.mkdir(parents=True, exist_ok=True)
    copy = bucket.staging_root / f"{TMP_PREFIX}restore-{secrets.token_hex(8)}"
    local = copy / PurePosixPath(save.path).name
    base = copy if save.prefix else local
    try:
        base.mkdir(parents=True)
        entries: list[save_manifest.FileEntry] = document["files"]
        with bucket.reading(f"downloading {save.path}"):
            futures = []
            for entry in entries:
                (base / entry.path).parent.mkdir(parents=True, exist_ok=True)
                futures.append(
                    bucket.transfer.download(
                        bucket.name,
                        files_base + entry.path,
                        str(base / entry.path),
                        subscribers=[Progress(progress)] if progress is not None else None,
                    )
                )
            for future in futures:
                future.result()
        for entry in entries:
            size, value = save_manifest.file_checksum(base / entry.path)
            if size != entry.size or f"{value:08x}" != entry.crc32c.lower():
                raise ChecksumError(
                    f"{files_base + entry.path} in {bucket.url} does not match its manifest "
                    f"({size} bytes, CRC32C {value:08x}; the manifest says {entry.size}, {entry.crc32c})"
                )
        if not save.prefix:  # the dir as the local store has it, manifest included
            manifest_body = {**document, "files": [vars(e) for e in entries]}
            (local / MANIFEST).write_bytes(save_manifest.encode_manifest(manifest_body))
        yield replace(save, path=local)
    finally:
        shutil.rmtree(copy, ignore_errors=True)


# One ranged GET's size, and how many run at once: enough to keep the link
# busy while the pieces already in are sent; the bytes held are at most
# their product (the pieces in flight) plus the one being sent. A GET of one
# chunk's size goes out as that chunk, with no slice copied.
GET_BYTES = FILE_CHUNK_BYTES
GETS_IN_FLIGHT = 8


def files_of(bucket: Bucket, save: CommittedSave) -> list[SavedFile]:
    """Every file of a committed save in the bucket, from its manifest.

    The manifest that found the save (read by its lookup, just before) is
    used again rather than read a second time: on a fresh daemon each
    RestoreFiles call costs a round trip less.

    Raises:
        RunNotFoundError: the save is no longer committed.
        UnavailableError: the object store failed.
    """
    key = bucket.keys_of(save).manifest
    document = bucket.last_read_manifest(key)
    if document is None:
        with bucket.reading(f"reading {save.path}"):
            document = bucket.manifest(key, None)
    if document is None:
        raise RunNotFoundError(f"the save {save.path} in {bucket.url} is no longer committed")
    entries: list[save_manifest.FileEntry] = document["files"]
    return [SavedFile(e.path, e.size, int(e.crc32c, 16)) for e in entries]


def read_ranges(bucket: Bucket, save: CommittedSave, ranges: Sequence[tuple[str, int, int]]) -> Iterator[bytes]:
    """Each (path, offset, length) of the save's files, in order, in pieces of at most FILE_CHUNK_BYTES.

    Ranged GETs of `GET_BYTES` run `GETS_IN_FLIGHT` at a time on a pool of
    this call's own; a piece is yielded once it and every piece before it
    are in, while the later ones download.

    Raises:
        UnavailableError: a GET failed.
        SaveFailedError: the bucket answered fewer bytes than asked.
    """
    files_base = bucket.keys_of(save).files_base
    gets = [
        (files_base + path, at, min(GET_BYTES, offset + length - at))
        for path, offset, length in ranges
        for at in range(offset, offset + length, GET_BYTES)
    ]

    def get(key: str, at: int, size: int) -> bytes:
        answer = bucket.client.get_object(Bucket=bucket.name, Key=key, Range=f"bytes={at}-{at + size - 1}")
        data: bytes = answer["Body"].read()
        if len(data) != size:
            raise SaveFailedError(f"{key} in {bucket.url}: {len(data)} bytes at {at}, {size} asked")
        return data

    pool = concurrent.futures.ThreadPoolExecutor(GETS_IN_FLIGHT, thread_name_prefix="restore-get")
    pending: collections.deque[concurrent.futures.Future[bytes]] = collections.deque()
    try:
        queued = iter(gets)
        for key, at, size in queued:
            pending.append(pool.submit(get, key, at, size))
            if len(pending) >= GETS_IN_FLIGHT:
                break
        while pending:
            with bucket.reading(f"reading {save.path}"):
                data = pending.popleft().result()
            for key, at, size in queued:  # one more in flight for the one taken
                pending.append(pool.submit(get, key, at, size))
                break
            if len(data) <= FILE_CHUNK_BYTES:
                yield data
                continue
            view = memoryview(data)
            for start in range(0, len(data), FILE_CHUNK_BYTES):
                yield bytes(view[start : start + FILE_CHUNK_BYTES])
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True)


# A staged restore's GETs: no message limit applies, so as big as the raw
# parallel GET that is its yardstick; the bytes held are at most their
# product (a GET's bytes go once written and folded into the CRC32C).
STAGE_GET_BYTES = 16 << 20
STAGE_GETS_IN_FLIGHT = 8


def stage_ranges(
    bucket: Bucket, save: CommittedSave, ranges: Sequence[tuple[str, int, int]], fds: Mapping[str, int]
) -> Generator[tuple[str, int, int, int], None, None]:
    """Each (path, offset, length) of the save's files written into `fds[path]` at its offset, by ranged GETs.

    `STAGE_GETS_IN_FLIGHT` GETs of `STAGE_GET_BYTES` run at a time on a pool
    of this call's own. Each thread writes its GET's bytes (pwrite) and
    folds them into its range's CRC32C once the GET before it in that range
    has (the pool starts GETs in order, so that one is running or done).

    Yields:
        (path, offset, length, crc32c) of each range, in order, once every
        byte of it is written.

    Raises:
        UnavailableError: a GET failed.
        SaveFailedError: the bucket answered fewer bytes than asked.
        OSError: a write failed (ENOSPC: the staging dir is full).
    """
    files_base = bucket.keys_of(save).files_base

    def get(path: str, at: int, size: int, before: concurrent.futures.Future[int] | None) -> int:
        key = files_base + path
        answer = bucket.client.get_object(Bucket=bucket.name, Key=key, Range=f"bytes={at}-{at + size - 1}")
        data: bytes = answer["Body"].read()  # (its readinto would read into a bytes first, then copy)
        if len(data) != size:
            raise SaveFailedError(f"{key} in {bucket.url}: {len(data)} bytes at {at}, {size} asked")
        view, done = memoryview(data), 0
        while done < size:
            done += os.pwrite(fds[path], view[done:], at + done)
        return wire.crc32c_of(data, before.result() if before is not None else 0)

    pool = concurrent.futures.ThreadPoolExecutor(STAGE_GETS_IN_FLIGHT, thread_name_prefix="restore-stage")
    submitted: collections.deque[concurrent.futures.Future[int]] = collections.deque()
    # Each range with its last GET (None: empty), yielded in order once that is in.
    ends: collections.deque[tuple[tuple[str, int, int], concurrent.futures.Future[int] | None]] = collections.deque()

    def ready(wait: bool) -> Iterator[tuple[str, int, int, int]]:
        while ends and (wait or ends[0][1] is None or ends[0][1].done()):
            one, last = ends.popleft()
            with bucket.reading(f"reading {save.path}"):
                yield (*one, last.result() if last is not None else 0)

    try:
        for path, offset, length in ranges:
            before: concurrent.futures.Future[int] | None = None
            for at in range(offset, offset + length, STAGE_GET_BYTES):
                while len(submitted) >= STAGE_GETS_IN_FLIGHT:  # the window: wait for the oldest
                    with bucket.reading(f"reading {save.path}"):
                        submitted.popleft().result()
                    yield from ready(False)
                before = pool.submit(get, path, at, min(STAGE_GET_BYTES, offset + length - at), before)
                submitted.append(before)
            ends.append(((path, offset, length), before))
            yield from ready(False)
        yield from ready(True)
    finally:
        for future in submitted:
            future.cancel()
        pool.shutdown(wait=True)
