"""A data file's multipart upload, each part sent as soon as its byte range of the file is written.

A streamed save's bundle data file is written where each tensor goes, in
the wire's order, not the file's (a policy's variables arrive in manifest
order, they lie in object-graph order). The sink reports each written range
(`checkpointd.core.ports.WatchedSink`); this counts the bytes covered per
part (each byte is written once) and sends a part the moment all of its
bytes are in, read back from the staged file (the page cache), so the
upload overlaps the receive.

Nothing is visible under the object's key until `complete`, which the
store calls at commit after the old save's manifest is gone and before the
new manifest: the commit protocol is unchanged. `abort` (a failed or given
up save) drops the parts; a crash leaves a multipart upload that
`s3_recovery` aborts after the grace age.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import Executor, Future
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

from checkpointd.core.ports import WatchedSink
from checkpointd.storage import s3_keys

_LOGGER = logging.getLogger(__name__)


class PartUpload:
    """The multipart upload of one staged data file to `key`; thread-safe."""

    def __init__(
        self, client: Any, bucket: str, key: str, path: Path, size: int, part_bytes: int, executor: Executor
    ) -> None:
        """Opens the file and starts the upload (in `executor`, so the accept does not wait for it).

        Raises:
            OSError: the staged data file cannot be opened.
        """
        self.client, self.bucket, self.key, self.size = client, bucket, key, size
        self.part_bytes = part_bytes
        self.count = max(1, -(-size // part_bytes))
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # kept: the commit may rename the file
        self._executor = executor
        self._lock = threading.Lock()
        self._covered = [0] * self.count
        self._sent: dict[int, Future[dict[str, Any]]] = {}
        self._ended = False
        self._created: Future[str] = executor.submit(self._create)

    def _create(self) -> str:
        return str(self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key)["UploadId"])

    def _span(self, part: int) -> tuple[int, int]:
        start = part * self.part_bytes
        return start, min(self.size, start + self.part_bytes)

    def on_range(self, start: int, end: int) -> None:
        """Counts `[start, end)` as written; sends each part it completes."""
        with self._lock:
            if self._ended:
                return
            first, last = start // self.part_bytes, (max(end, start + 1) - 1) // self.part_bytes
            for part in range(first, min(last, self.count - 1) + 1):
                lo, hi = self._span(part)
                self._covered[part] += max(0, min(end, hi) - max(start, lo))
                if self._covered[part] >= hi - lo and part not in self._sent:
                    self._sent[part] = self._executor.submit(self._send, part)

    def _send(self, part: int) -> dict[str, Any]:
        upload_id = self._created.result()
        lo, hi = self._span(part)
        body = os.pread(self._fd, hi - lo, lo)
        if len(body) != hi - lo:
            raise OSError(f"{self.key}: part {part + 1} has {len(body)} bytes in staging, {hi - lo} expected")
        answer = self.client.upload_part(
            Bucket=self.bucket, Key=self.key, UploadId=upload_id, PartNumber=part + 1, Body=body
        )
        return {"ETag": answer["ETag"], "PartNumber": part + 1}

    def sent_early(self) -> int:
        """How many parts were sent before `complete` (as their ranges filled)."""
        with self._lock:
            return len(self._sent)

    def complete(self) -> str:
        """Sends the parts not sent yet, waits for all, completes the object; returns its ETag ('' if none).

        Raises:
            Exception: a part or the completion failed (the caller aborts).
        """
        with self._lock:
            for part in range(self.count):
                if part not in self._sent:
                    self._sent[part] = self._executor.submit(self._send, part)
            futures = [self._sent[p] for p in range(self.count)]
        parts = [f.result() for f in futures]
        answer = self.client.complete_multipart_upload(
            Bucket=self.bucket, Key=self.key, UploadId=self._created.result(), MultipartUpload={"Parts": parts}
        )
        with self._lock:
            self._ended = True
        self._close()
        return str(answer.get("ETag") or "").strip('"')

    def abort(self) -> None:
        """Drops the upload and its parts (best effort; recovery aborts what is left)."""
        with self._lock:
            self._ended = True
            futures = list(self._sent.values())
        for future in futures:
            future.cancel()
        for future in futures:
            with contextlib.suppress(BaseException):
                future.result()
        try:
            upload_id = self._created.result()
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=upload_id)
        except Exception as e:
            _LOGGER.warning("could not abort the multipart upload of %s (recovery will): %s", self.key, e)
        self._close()

    def _close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def start(
    client: Any,
    bucket: str,
    part_bytes: int,
    executor: Executor,
    staging: Path,
    target: PurePath,
    sink: WatchedSink,
) -> PartUpload | None:
    """The multipart upload of a streamed save's data file (staged in `staging`) under its final key, or None.

    Only a data file of at least one part streams; a smaller save goes up
    whole at commit.

    Raises:
        OSError: the staged data file cannot be opened.
    """
    early: list[tuple[int, int]] = []
    upload: list[PartUpload] = []

    def on_range(begin: int, end: int) -> None:
        if upload:
            upload[0].on_range(begin, end)
        else:  # reported by `watch` itself, before the upload exists
            early.append((begin, end))

    path, size = sink.watch(on_range)
    if size < part_bytes:
        return None
    rel = Path(path).relative_to(staging).as_posix()
    is_prefix = "/" not in rel  # a training checkpoint's files sit in staging, renamed at commit
    if is_prefix:
        rel = PurePosixPath(target).name + "." + rel.partition(".")[2]
    key = s3_keys.keys_of(target, prefix=is_prefix).files_base + rel
    part = PartUpload(client, bucket, key, Path(path), size, part_bytes, executor)
    for start_at, end_at in early:
        part.on_range(start_at, end_at)
    upload.append(part)
    return part
