"""A data file's multipart upload, each part sent as soon as its byte range of the file is written.

A streamed save's bundle data file is written where each tensor goes, in
the wire's order, not the file's (a policy's variables arrive in manifest
order, they lie in object-graph order). The sink reports each written range
(`checkpointd.core.ports.WatchedSink`); this counts the bytes covered per
part (each byte is written once) and sends a part the moment all of its
bytes are in, read back from the staged file (the page cache), so the
upload overlaps the receive.

An incremental save's unchanged ranges are never written to staging: the
sink names them (`referred`), and `complete` has the parts that hold any
copied from the base object server-side (`checkpointd.storage.s3.part_copy`).
A part sent early is one wholly written; the parts planned at `complete`
take the part numbers after it (each early part leaves room for them).

Nothing is visible under the object's key until `complete`, which the
store calls at commit after the old save's manifest is gone and before the
new manifest: the commit protocol is unchanged. `abort` (a failed or given
up save) drops the parts; a crash leaves a multipart upload that
`recovery` aborts after the grace age.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path, PurePath, PurePosixPath
from typing import Any, cast

from checkpointd.core.ports import ReferencingSink, WatchedSink
from checkpointd.storage.s3 import part_copy
from checkpointd.storage.s3.keys import keys_of

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
        # Part numbers per part_bytes of the file: room for the parts a plan cuts it into.
        self.stride = max(1, part_copy.MAX_PARTS // self.count)
        self._refs: list[part_copy.Reference] = []
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # kept: the commit may rename the file
        self._executor = executor
        self._lock = threading.Lock()
        self._covered = [0] * self.count
        self._sent: dict[int, list[Future[dict[str, Any]]]] = {}  # per part_bytes slot: its part(s)
        self._ended = False
        self._uploaded = 0  # bytes sent from here (not copied server-side)
        self._max_bytes = max(part_bytes, 2 * part_copy.MIN_PART_BYTES)
        self._created: Future[str] = executor.submit(self._create)

    def _create(self) -> str:
        return str(self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key)["UploadId"])

    def _span(self, part: int) -> tuple[int, int]:
        start = part * self.part_bytes
        return start, min(self.size, start + self.part_bytes)

    def on_range(self, start: int, end: int) -> None:
        """Counts `[start, end)` as written; sends each part it completes."""
        with self._lock:
            self._cover(start, end)

    def _cover(self, start: int, end: int) -> None:
        """Counts `[start, end)` as accounted for (written or referred); sends each slot it completes. Locked."""
        if self._ended:
            return
        first, last = start // self.part_bytes, (max(end, start + 1) - 1) // self.part_bytes
        for part in range(first, min(last, self.count - 1) + 1):
            lo, hi = self._span(part)
            self._covered[part] += max(0, min(end, hi) - max(start, lo))
            if self._covered[part] >= hi - lo and part not in self._sent:
                refs = [r for r in self._refs if r.start < hi and lo < r.end]
                if not refs:
                    self._sent[part] = [self._executor.submit(self._send, part)]
                elif self.part_bytes >= part_copy.MIN_PART_BYTES:  # its copies and uploads, planned now
                    planned = part_copy.plan(lo, hi, refs, object_end=self.size, max_bytes=self._max_bytes)
                    if len(planned) <= self.stride:
                        self._sent[part] = self._submit(part, planned)

    def _send(self, part: int) -> dict[str, Any]:
        upload_id = self._created.result()
        lo, hi = self._span(part)
        with self._lock:
            self._uploaded += hi - lo
        body = os.pread(self._fd, hi - lo, lo)
        if len(body) != hi - lo:
            raise OSError(f"{self.key}: part {part + 1} has {len(body)} bytes in staging, {hi - lo} expected")
        number = part * self.stride + 1
        answer = self.client.upload_part(
            Bucket=self.bucket, Key=self.key, UploadId=upload_id, PartNumber=number, Body=body
        )
        return {"ETag": answer["ETag"], "PartNumber": number}

    def referred(self, start: int, end: int, source: part_copy.Source, offset: int) -> None:
        """Counts `[start, end)` as equal to `source`'s bytes at `offset`: copied at `complete`, not read from staging.

        Raises:
            ValueError: the file has too many parts for the copies' part numbers.
        """
        if self.stride < 4:  # a part_bytes slot may need up to part_bytes / 5 MiB + 1 parts
            raise ValueError(f"{self.key}: {self.count} parts leave no part numbers for copies")
        with self._lock:
            self._refs.append(part_copy.Reference(start, end, source, offset))
            self._cover(start, end)

    @property
    def referred_bytes(self) -> int:
        """The bytes referred to a base so far (staging lacks them)."""
        with self._lock:
            return sum(r.end - r.start for r in self._refs)

    @property
    def uploaded(self) -> int:
        """The bytes sent from this daemon, not copied server-side (once complete)."""
        return self._uploaded

    def _submit(self, slot: int, planned: list[part_copy.Part]) -> list[Future[dict[str, Any]]]:
        """Sends planned parts numbered from `slot`'s first number. Locked."""
        futures = []
        for n, part in enumerate(planned):
            self._uploaded += part.uploaded
            futures.append(self._executor.submit(self._send_planned, slot * self.stride + 1 + n, part))
        return futures

    def _send_planned(self, number: int, part: part_copy.Part) -> dict[str, Any]:
        upload_id = self._created.result()
        return part_copy.send(self.client, self.bucket, self.key, upload_id, number, part, self._fd)

    def _planned(self) -> list[Future[dict[str, Any]]]:
        """The parts not sent early, planned around the referred ranges and sent (copies and uploads). Locked."""
        futures = []
        slot = 0
        while slot < self.count:
            if slot in self._sent:
                slot += 1
                continue
            first = slot
            while slot < self.count and slot not in self._sent:
                slot += 1
            lo, hi = self._span(first)[0], self._span(slot - 1)[1]
            parts = part_copy.plan(lo, hi, self._refs, object_end=self.size, max_bytes=self._max_bytes)
            if len(parts) > (slot - first) * self.stride:
                raise ValueError(f"{self.key}: {len(parts)} parts for bytes [{lo}, {hi}) exceed their part numbers")
            futures += self._submit(first, parts)
        return futures

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
            if self._refs:
                self._sent[-1] = self._planned()  # numbered between the slots sent already
            else:
                for part in range(self.count):
                    if part not in self._sent:
                        self._sent[part] = [self._executor.submit(self._send, part)]
            futures = [f for sent in self._sent.values() for f in sent]
        parts = sorted((f.result() for f in futures), key=lambda p: int(p["PartNumber"]))
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
            futures = [f for sent in self._sent.values() for f in sent]
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
    key = keys_of(target, prefix=is_prefix).files_base + rel
    part = PartUpload(client, bucket, key, Path(path), size, part_bytes, executor)
    for start_at, end_at in early:
        part.on_range(start_at, end_at)
    upload.append(part)
    if isinstance(sink, ReferencingSink):  # an incremental save's unchanged ranges
        # The sources it names are those `S3Store.base_source` gave the save's base: `part_copy.Source`.
        sink.watch_references(cast(Callable[[int, int, object, int], None], part.referred))
    return part
