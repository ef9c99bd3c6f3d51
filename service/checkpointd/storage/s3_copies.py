"""Files a run's saves share (a policy's graph files) copied server-side from its previous save, not uploaded again.

Every SAVED_MODEL save of a run holds the same template files
(saved_model.pb, policy_specs.pbtxt, assets/...): only the variables and
fingerprint.pb change. The store remembers, per run, each file it
committed (key, size, CRC32C, ETag); a new save's file with the same path,
size and CRC32C is copied from that object with `CopyObject`, on condition
that its ETag is still the one committed (`CopySourceIfMatch`). A source
gone (retention, another daemon) or changed makes the copy fail, and the
file is uploaded as before. The new manifest's sizes and CRCs are the
staged file's, which the copy reproduces byte for byte.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from checkpointd.storage.s3_client import error_code

# Codes of a copy whose source is gone or no longer the committed bytes.
_SOURCE_GONE = frozenset({"404", "NoSuchKey", "NotFound", "412", "PreconditionFailed"})


@dataclass(frozen=True)
class Source:
    """A committed object another save may copy."""

    key: str
    size: int
    crc32c: str
    etag: str


class Sources:
    """Per run, the objects of the files it committed last, by path in a save; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, dict[str, Source]] = {}

    def remember(self, run: str, files: dict[str, Source]) -> None:
        """Records a committed save's files (path in the save -> object)."""
        with self._lock:
            self._runs.setdefault(run, {}).update(files)

    def matching(self, run: str, path: str, key: str, size: int, crc32c: str) -> Source | None:
        """The run's committed object with this file's bytes (same path, size, CRC32C), not `key` itself."""
        with self._lock:
            found = self._runs.get(run, {}).get(path)
        if found is None or found.key == key or found.size != size or found.crc32c.lower() != crc32c.lower():
            return None
        return found


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
