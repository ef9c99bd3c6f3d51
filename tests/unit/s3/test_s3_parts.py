"""A data file's multipart upload sent part by part as the sink reports its written ranges (no network)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from checkpointd.bundle import Entry
from checkpointd.bundle.sink import BundleSink
from checkpointd.core.ports import Staged
from checkpointd.storage.s3.parts import PartUpload


class FakeS3:
    """Records the multipart calls; each part's body as sent."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.parts: dict[int, bytes] = {}
        self.completed: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.fail_part: int | None = None

    def create_multipart_upload(self, **kw: Any) -> dict[str, Any]:
        return {"UploadId": "u1"}

    def upload_part(self, *, PartNumber: int, Body: bytes, **kw: Any) -> dict[str, Any]:  # noqa: N803
        if PartNumber == self.fail_part:
            raise OSError("the server refused the part")
        with self.lock:
            self.parts[PartNumber] = Body
        return {"ETag": f'"e{PartNumber}"'}

    def complete_multipart_upload(self, *, MultipartUpload: dict[str, Any], **kw: Any) -> dict[str, Any]:  # noqa: N803
        self.completed.append(MultipartUpload)
        return {"ETag": '"whole-3"'}

    def abort_multipart_upload(self, *, UploadId: str, **kw: Any) -> None:  # noqa: N803
        self.aborted.append(UploadId)


@pytest.fixture
def pool() -> Any:
    with ThreadPoolExecutor(2) as executor:
        yield executor


def test_a_part_goes_up_once_all_its_bytes_are_written_in_any_order_and_complete_sends_the_rest(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    data = bytes(range(256)) * 40  # 10240 bytes: parts of 4096, 4096, 2048
    path = tmp_path / "data"
    path.write_bytes(data)
    s3 = FakeS3()
    upload = PartUpload(s3, "b", "k", path, len(data), 4096, pool)
    upload.on_range(6000, 10240)  # part 3 whole, part 2 half
    upload.on_range(0, 3000)  # part 1 not yet whole
    assert upload.sent_early() == 1
    upload.on_range(3000, 6000)  # parts 1 and 2 whole now
    assert upload.sent_early() == 3
    assert upload.complete() == "whole-3"
    # Numbered apart, leaving room for the parts an incremental save's copies may add between.
    numbers = [1, 1 + upload.stride, 1 + 2 * upload.stride]
    assert s3.parts == dict(zip(numbers, [data[:4096], data[4096:8192], data[8192:]], strict=True))
    assert [p["PartNumber"] for p in s3.completed[0]["Parts"]] == numbers
    assert not s3.aborted


def test_parts_never_covered_are_sent_at_complete(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    data = b"x" * 9000
    (tmp_path / "data").write_bytes(data)
    s3 = FakeS3()
    upload = PartUpload(s3, "b", "k", tmp_path / "data", len(data), 4096, pool)
    upload.on_range(0, 100)  # e.g. bytes written before the watch began
    assert upload.sent_early() == 0
    upload.complete()
    assert b"".join(s3.parts[n] for n in sorted(s3.parts)) == data


def test_a_failed_part_fails_complete_and_abort_drops_the_upload(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    (tmp_path / "data").write_bytes(b"y" * 9000)
    s3 = FakeS3()
    upload = PartUpload(s3, "b", "k", tmp_path / "data", 9000, 4096, pool)
    s3.fail_part = 1 + upload.stride  # the second
    upload.on_range(0, 9000)
    with pytest.raises(OSError, match="refused the part"):
        upload.complete()
    assert not s3.completed
    upload.abort()
    assert s3.aborted == ["u1"]
    upload.on_range(0, 9000)  # after the end: ignored
    assert upload.sent_early() == 3


def test_the_sink_reports_each_written_range_of_its_data_file_once(tmp_path: Path) -> None:
    entries = [Entry("a", "float32", (4,), 16), Entry("b", "float32", (2,), 8), Entry("c", "float32", (8,), 32)]
    ranges: list[tuple[int, int]] = []

    def finish(index: bytes, tail: bytes) -> Staged:
        return Staged(tmp_path, 0, {})

    with BundleSink(tmp_path / "v", entries, [2, 0, 1, None], [32, 16, 8, 0], finish) as sink:
        path, size = sink.watch(lambda start, end: ranges.append((start, end)))
        assert (path, size) == (tmp_path / "v.data-00000-of-00001", 56)
        sink.write(0, 0, b"c" * 20)  # tensor c lies at [24, 56)
        sink.write(0, 20, b"c" * 12)
        sink.write(1, 0, b"a" * 16)
        sink.write(2, 0, b"b" * 8)
        sink.finish()
    assert ranges == [(24, 44), (44, 56), (0, 16), (16, 24)]
    assert path.read_bytes() == b"a" * 16 + b"b" * 8 + b"c" * 32


class CopyingS3(FakeS3):
    """FakeS3 that also copies part ranges from (and reads ranges of) objects it holds."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        super().__init__()
        self.objects = objects
        self.copied = 0

    @staticmethod
    def _range(spec: str) -> slice:
        lo, hi = spec.removeprefix("bytes=").split("-")
        return slice(int(lo), int(hi) + 1)

    def upload_part_copy(
        self, *, PartNumber: int, CopySource: dict[str, str], CopySourceRange: str, **kw: Any
    ) -> dict[str, Any]:  # noqa: N803
        body = self.objects[CopySource["Key"]][self._range(CopySourceRange)]
        with self.lock:
            self.parts[PartNumber] = body
            self.copied += len(body)
        return {"CopyPartResult": {"ETag": f'"c{PartNumber}"'}}

    def get_object(self, *, Key: str, Range: str, **kw: Any) -> dict[str, Any]:  # noqa: N803
        import io

        return {"Body": io.BytesIO(self.objects[Key][self._range(Range)])}


def test_referred_ranges_are_copied_from_the_base_and_only_written_bytes_uploaded(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    from checkpointd.storage.s3.part_copy import MIN_PART_BYTES, Source

    mib = 1 << 20
    base = bytes(range(256)) * (18 * mib // 256)  # the base object: 18 MiB
    data = bytearray(base)
    data[7 * mib : 7 * mib + 10] = b"x" * 10  # one changed chunk in the second 6 MiB part
    path = tmp_path / "data"
    path.write_bytes(bytes(data[:0]))  # staging holds only what was written
    with open(path, "r+b") as f:
        f.seek(7 * mib)
        f.write(data[7 * mib : 8 * mib])
    s3 = CopyingS3({"base": base})
    upload = PartUpload(s3, "b", "k", path, len(data), 6 * mib, pool)
    source = Source("base", "e")
    upload.referred(0, 7 * mib, source, 0)
    upload.on_range(7 * mib, 8 * mib)
    upload.referred(8 * mib, 18 * mib, source, 8 * mib)
    upload.complete()
    numbers = sorted(s3.parts)
    assert [p["PartNumber"] for p in s3.completed[0]["Parts"]] == numbers
    assert b"".join(s3.parts[n] for n in numbers) == bytes(data)
    assert all(len(s3.parts[n]) >= MIN_PART_BYTES for n in numbers[:-1])
    # The changed MiB's part [6, 12) MiB: its unchanged runs (1 and 4 MiB) are under a part, so they go up
    # with it, read from the base; the other two parts are copies.
    assert upload.uploaded == 6 * mib
    assert s3.copied == len(data) - 6 * mib
