"""Steps 3 and 4 of an S3 save's commit (`checkpointd.storage.s3`): every file up, then the fenced manifest.

Each file goes up under its final key (up to 1 MiB, one PutObject through
`signed` where the client has it, sent by the commit thread itself;
otherwise s3transfer; a streamed data file's multipart upload completed; a
file the run's previous save committed with the same bytes copied
server-side instead, but for the smallest, `copies.sent_instead`), each
object's ETag taken from the server's answer, and the manifest, with the
ETags and the writer, created last with `IfNoneMatch='*'` between two lease
fences.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
from pathlib import Path, PurePosixPath
from typing import Any

from checkpointd.core.ports import SaveMeta, Staged
from checkpointd.protocol.errors import ChecksumError
from checkpointd.storage import save_manifest
from checkpointd.storage.s3.bucket import Bucket
from checkpointd.storage.s3.client import error_code
from checkpointd.storage.s3.copies import Source, copy_first, sent_instead
from checkpointd.storage.s3.keys import ETAGS, MANIFEST, WRITER

_LOGGER = logging.getLogger(__name__)
_DIRECT_BYTES = 1 << 20  # a file up to this size goes up in one request, read whole (not through s3transfer)


def upload(
    bucket: Bucket, staged: Staged, files_base: str, manifest_key: str, meta: SaveMeta
) -> tuple[int, set[str], int]:
    """Uploads a save's files, then its manifest (fenced); returns (bytes sent, files listed, manifest bytes).

    Every file goes up at once. Each object's ETag is the one its PutObject or
    CompleteMultipartUpload answered (`_ETagLog`): the server took the
    whole body, checked against its signed SHA-256 or Content-MD5, so no
    HEAD per object is needed to learn it (a small file's PutObject through
    `bucket.small` returns it directly). Only an object whose answer
    had no ETag (radosgw's CompleteMultipartUpload) is read back with a
    HEAD, its size checked too.
    """
    files = staged_files(staged.path)
    keys = {files_base + rel: rel for rel in files}
    futures: list[Any] = []
    copies: dict[str, Any] = {}
    manifest_bytes = save_manifest.write_staged_manifest(staged, meta)
    part = bucket.stream_of(staged.path)
    if part is not None and part.key not in keys:  # not where the format put it: send it whole
        bucket.discard_stream(staged.path)
        if part.referred_bytes:  # staging lacks the unchanged ranges: the client sends them
            raise ChecksumError(f"{part.key} is not the data file's key; send the save again in full")
        part = None
    document = json.loads((staged.path / MANIFEST).read_bytes())
    entries = {str(e["path"]): (int(e["size"]), str(e["crc32c"])) for e in document["files"]}
    sources = {
        key: found
        for key, rel in keys.items()
        if rel in entries
        and (part is None or key != part.key)  # streamed already
        and (found := bucket.sources.matching(meta.run, rel, key, *entries[rel]))
    }
    for key in sent_instead({key: entries[keys[key]][0] for key in sources}):
        del sources[key]
    sent = sum(entries.get(rel, (0, ""))[0] for key, rel in keys.items() if key not in sources)
    with bucket.etag_log.awaiting(bucket.name, keys) as etags:
        try:
            copies = {
                key: bucket.parts_pool.submit(
                    copy_first, bucket.small, bucket.name, bucket.sources, meta.run, keys[key], src, key
                )
                for key, src in sources.items()
            }
            futures = [
                _upload(bucket, staged.path / rel, key, entries.get(rel, (bucket.part_bytes, ""))[0], etags)
                for key, rel in keys.items()
                if (part is None or key != part.key) and key not in sources
            ]
            for key, copied in copies.items():
                etag = copied.result()
                if etag is None:  # the source is gone or changed: upload the file after all
                    futures.append(_upload(bucket, staged.path / keys[key], key, entries[keys[key]][0], etags))
                    sent += entries[keys[key]][0]
                elif etag:
                    etags[key] = etag
            if part is not None:
                etag = part.complete()  # after the old manifest went: the object appears now
                sent -= part.size - part.uploaded  # copied from an incremental save's base, server-side
                with bucket.lock:
                    bucket.streams.pop(str(staged.path), None)
                if etag:
                    etags[part.key] = etag
            for future in futures:
                future.result()  # raises the first failure; the manifest is not written
        except BaseException:
            for future in [*futures, *copies.values()]:  # none may still read the staged files
                future.cancel()
            for future in futures:
                with contextlib.suppress(BaseException):
                    future.result()
            raise
    listed = {entry["path"] for entry in document["files"]}
    if listed != set(files):
        raise OSError(f"the staged files of {files_base} changed during the upload ({sorted(listed ^ set(files))})")
    sizes = {entry["path"]: int(entry["size"]) for entry in document["files"]}
    for key, rel in keys.items():
        if key not in etags:  # radosgw answers a CompleteMultipartUpload with an empty ETag
            head = bucket.small.head_object(Bucket=bucket.name, Key=key)
            if head["ContentLength"] != sizes[rel]:
                raise ChecksumError(f"{key} has {head['ContentLength']} bytes in the bucket, {sizes[rel]} were sent")
            etags[key] = head["ETag"].strip('"')
    document[ETAGS] = {rel: etags[key] for key, rel in keys.items()}
    if bucket.writer is not None:
        document[WRITER] = bucket.writer
    body = save_manifest.encode_manifest(document)  # the local store's layout, by its C-encoder path
    bucket.fence(meta.run)  # the lease, checked last before the commit
    try:
        bucket.small.put_object(Bucket=bucket.name, Key=manifest_key, Body=body, IfNoneMatch="*")
    except Exception as e:
        if error_code(e) in ("PreconditionFailed", "412"):
            raise OSError(f"another writer committed {manifest_key} meanwhile; this save is not committed") from e
        raise
    try:
        bucket.fence(meta.run)  # lost during the PUT (a pause past the margin): withdraw it
    except Exception:
        _LOGGER.warning("run %s: the lease was lost while %s was written; withdrawing it", meta.run, manifest_key)
        bucket.delete_keys([manifest_key])
        raise
    bucket.sources.remember(
        meta.run,
        {rel: Source(key, *entries[rel], etags[key]) for key, rel in keys.items() if rel in entries},
    )
    return sent + len(body), listed, manifest_bytes


def _upload(bucket: Bucket, path: Path, key: str, size: int, etags: dict[str, str]) -> Any:
    """Uploads one file, or starts to; a future. A small file is one PutObject of its bytes
    (`bucket.small`), sent here and now, while the copies and larger files go up in their threads (a
    hand-off to a pool costs more than the request); its ETag is put in `etags`. A larger file
    goes through s3transfer (multipart above `part_bytes`)."""
    if size > _DIRECT_BYTES or bucket.small is bucket.client:
        return bucket.transfer.upload(str(path), bucket.name, key)
    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    try:
        etags[key] = _etag(bucket.small.put_object(Bucket=bucket.name, Key=key, Body=path.read_bytes()))
    except Exception as e:  # raised where every upload's failure is: at its future's result()
        done.set_exception(e)
    else:
        done.set_result(None)
    return done


def _etag(answer: dict[str, Any]) -> str:
    return str(answer.get("ETag") or "").strip('"')


def staged_files(staged: Path) -> list[str]:
    """Every file of a staged save but its manifest, '/'-separated, sorted (as its manifest lists them).

    Raises:
        OSError: an entry is not a regular file (a symlink, say): nothing of
            the save may go up, as its manifest would refuse it only later.
    """
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(staged):
        rel = PurePosixPath(Path(dirpath).relative_to(staged).as_posix())
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isfile(path):
                raise OSError(f"{path} is not a regular file; a save holds only regular files")
            found.append(str(rel / name))
    return sorted(f for f in found if f != MANIFEST)
