"""Restore from the object store: a committed save downloaded and checked against its manifest.

Restore reads a local copy (`local_copy`), each file checked against the
manifest's size and CRC32C before anything is yielded.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from checkpointd.core.ports import CommittedSave
from checkpointd.protocol.errors import ChecksumError, RunNotFoundError
from checkpointd.protocol.names import TMP_PREFIX
from checkpointd.storage import save_manifest
from checkpointd.storage.s3_client import Progress
from checkpointd.storage.s3_keys import MANIFEST

if TYPE_CHECKING:
    from checkpointd.storage.s3 import S3Store


@contextlib.contextmanager
def local_copy(
    store: S3Store, save: CommittedSave, progress: Callable[[int], None] | None = None
) -> Iterator[CommittedSave]:
    """Downloads a committed save into the store's staging dir, checks it against its manifest, yields it there.

    The copy is the save as the local store would hold it (a dir with its
    manifest, or a prefix's files in a dir); it is deleted when the block ends.

    Raises:
        RunNotFoundError: the save is no longer committed.
        ChecksumError: a file does not match its manifest's size or CRC32C.
        UnavailableError: the object store failed.
    """
    place = store.keys_of(save)
    files_base, manifest_key = place.files_base, place.manifest
    with store.reading(f"reading {save.path}"):
        document = store.manifest(manifest_key, None)
    if document is None:
        raise RunNotFoundError(f"the save {save.path} in {store.url} is no longer committed")
    store.staging_root.mkdir(parents=True, exist_ok=True)
    copy = store.staging_root / f"{TMP_PREFIX}restore-{secrets.token_hex(8)}"
    local = copy / PurePosixPath(save.path).name
    base = copy if save.prefix else local
    try:
        base.mkdir(parents=True)
        entries: list[save_manifest.FileEntry] = document["files"]
        with store.reading(f"downloading {save.path}"):
            futures = []
            for entry in entries:
                (base / entry.path).parent.mkdir(parents=True, exist_ok=True)
                futures.append(
                    store.transfer.download(
                        store.bucket,
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
                    f"{files_base + entry.path} in {store.url} does not match its manifest "
                    f"({size} bytes, CRC32C {value:08x}; the manifest says {entry.size}, {entry.crc32c})"
                )
        if not save.prefix:  # the dir as the local store has it, manifest included
            manifest_body = {**document, "files": [vars(e) for e in entries]}
            (local / MANIFEST).write_text(json.dumps(manifest_body, indent=1) + "\n")
        yield replace(save, path=local)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
