"""Files a run's saves share (a policy's graph files) copied server-side from its previous save, not uploaded again.

Every SAVED_MODEL save of a run holds the same template files
(saved_model.pb, policy_specs.pbtxt, assets/...): only the variables and
fingerprint.pb change. The store remembers, per run, each file it
committed (key, size, CRC32C, ETag); a new save's file with the same path,
size and CRC32C is copied from such an object with `CopyObject`, on
condition that its ETag is still the one committed (`CopySourceIfMatch`).
A source gone (retention, another daemon) or changed makes the copy fail:
it is forgotten and the next one tried, newest first, and with none left
the file is uploaded as before. The new manifest's sizes and CRCs are the
staged file's, which the copy reproduces byte for byte.

The smallest such files are sent instead (`sent_instead`), up to 32 KiB a
save: a PutObject of a few KiB on hand costs the server less CPU than a
CopyObject, and on radosgw is answered much sooner (bench/README.md); a
policy's graph, the bulk of its bytes, is still copied.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from checkpointd.storage.s3.client import error_code

# Codes of a copy whose source is gone or no longer the committed bytes.
_SOURCE_GONE = frozenset({"404", "NoSuchKey", "NotFound", "412", "PreconditionFailed"})


@dataclass(frozen=True)
class Source:
    """A committed object another save may copy."""

    key: str
    size: int
    crc32c: str
    etag: str


_KEPT = 8  # sources kept per (run, path, bytes): enough to outlive a retention that deletes the newest
SENT_INSTEAD_BYTES = 32 << 10  # a save's copyable bytes sent instead, its smallest files first


def sent_instead(sizes: Mapping[str, int]) -> set[str]:
    """Of a save's copyable files (key -> bytes), those to send instead: the smallest first, SENT_INSTEAD_BYTES in all."""
    chosen: set[str] = set()
    total = 0
    for key, size in sorted(sizes.items(), key=lambda item: (item[1], item[0])):
        if total + size > SENT_INSTEAD_BYTES:
            break
        chosen.add(key)
        total += size
    return chosen


class Sources:
    """Per run, the objects of the files it committed, by path in a save and bytes, newest first; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[tuple[str, str, int, str], list[Source]] = {}

    def remember(self, run: str, files: dict[str, Source]) -> None:
        """Records a committed save's files (path in the save -> object)."""
        with self._lock:
            for path, source in files.items():
                kept = self._kept.setdefault((run, path, source.size, source.crc32c.lower()), [])
                kept[:] = [source, *(s for s in kept if s.key != source.key)][:_KEPT]

    def matching(self, run: str, path: str, key: str, size: int, crc32c: str) -> list[Source]:
        """The run's committed objects with this file's bytes (same path, size, CRC32C), newest first, not `key`."""
        with self._lock:
            return [s for s in self._kept.get((run, path, size, crc32c.lower()), []) if s.key != key]

    def forget(self, run: str, path: str, source: Source) -> None:
        """Drops a source found gone or changed."""
        with self._lock:
            kept = self._kept.get((run, path, source.size, source.crc32c.lower()), [])
            kept[:] = [s for s in kept if s is not source]


def copy_first(
    client: Any, bucket: str, sources: Sources, run: str, path: str, found: list[Source], key: str
) -> str | None:
    """Copies the first of `found` still there to `key` (forgetting the others tried); its ETag, None if none was."""
    for source in found:
        etag = copy(client, bucket, source, key)
        if etag is not None:
            return etag
        sources.forget(run, path, source)
    return None


def copy(client: Any, bucket: str, source: Source, key: str) -> str | None:
    """Copies `source` to `key` if it still has the committed ETag; its new ETag ('' if none), or None if gone.

    Raises:
        Exception: the copy failed otherwise (the save fails as an upload would).
    """
    try:
        answer = client.copy_object(
            Bucket=bucket,
            Key=key,
            CopySource={"Bucket": bucket, "Key": source.key},
            CopySourceIfMatch=f'"{source.etag}"',
        )
    except Exception as e:
        if error_code(e) in _SOURCE_GONE:
            return None
        raise
    return str(answer.get("CopyObjectResult", {}).get("ETag") or "").strip('"')
