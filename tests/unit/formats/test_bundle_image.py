"""checkpointd.bundle.image and BundleSink.write_image: a segment laid out as the data file, written with O_DIRECT."""

from __future__ import annotations

import errno
import logging
import mmap
import os
from pathlib import Path

import crc32c
import pytest

from checkpointd import bundle
from checkpointd.bundle import image, sink, table
from checkpointd.core.ports import Staged
from checkpointd.durable import direct

# Data order: a (uint8 x 5000), py (a scalar string of 11 bytes), w (float32 x 3), graph (known at open).
GRAPH = b"G" * 300
PY = b"python\x00stat"
A = bytes(range(256)) * 19 + bytes(136)  # 5000 bytes
W = b"\x01\x02\x03\x04" * 3
ENTRIES = [
    bundle.Entry("a", "uint8", (5000,), 5000),
    bundle.Entry("py", "string", (), bundle.string_size([len(PY)])),
    bundle.Entry("w", "float32", (3,), 12),
    bundle.string_entry("graph", GRAPH),
]
# Wire order: w, a, py, then an empty tail.
ROUTES: list[int | None] = [2, 0, 1, None]
PARTS = [12, 5000, len(PY), 0]
VALUES = [W, A, PY, b""]


def test_each_part_sits_at_its_tensors_place_in_the_data_file_and_the_image_is_whole_blocks() -> None:
    offsets, size = image.layout(ENTRIES, ROUTES, PARTS)  # type: ignore[misc]
    head = len(table.varint(len(PY))) + 4  # a scalar string's length, then its masked CRC32C
    data_size = 5000 + head + len(PY) + 12 + bundle.string_size([len(GRAPH)])
    assert offsets == [5000 + head + len(PY), 0, 5000 + head, data_size]
    assert size == direct.ALIGNMENT * 2 and size - direct.ALIGNMENT < data_size <= size


def test_a_tail_of_bytes_has_no_place_in_the_image() -> None:
    assert image.layout(ENTRIES, ROUTES, [12, 5000, len(PY), 4]) is None


@pytest.mark.parametrize(("n", "up"), [(0, 0), (1, 4096), (4096, 4096), (4097, 8192)])
def test_round_up_to_whole_blocks(n: int, up: int) -> None:
    assert direct.round_up(n) == up


@pytest.fixture(autouse=True)
def _any_image_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """These bundles are a few KiB: written as an image all the same."""
    monkeypatch.setattr(sink, "_DIRECT_MIN_BYTES", 0)


def _open(directory: Path) -> sink.BundleSink:
    directory.mkdir()

    def finish(index: bytes, tail: bytes) -> Staged:
        return Staged(path=directory, bytes_written=0, versions={})

    return sink.BundleSink(directory / "x", ENTRIES, ROUTES, PARTS, finish, strings={3: GRAPH})


def _segment(offsets: list[int], size: int) -> memoryview:
    """A page-aligned map holding each part's value at its offset, and junk elsewhere (the image's gaps)."""
    whole = memoryview(mmap.mmap(-1, size))
    whole[:] = b"\xee" * size
    for at, value in zip(offsets, VALUES, strict=True):
        whole[at : at + len(value)] = value
    return whole


def _files(directory: Path) -> tuple[bytes, bytes]:
    return (directory / ("x" + bundle.INDEX_SUFFIX)).read_bytes(), (directory / ("x" + bundle.DATA_SUFFIX)).read_bytes()


def _expected(tmp_path: Path) -> tuple[bytes, bytes]:
    values: list[object] = [A, [PY], W, [GRAPH]]
    bundle.write(tmp_path / "y", [*ENTRIES[:1], bundle.string_entry("py", PY), *ENTRIES[2:]], values)
    return (tmp_path / ("y" + bundle.INDEX_SUFFIX)).read_bytes(), (tmp_path / ("y" + bundle.DATA_SUFFIX)).read_bytes()


def _write_image(directory: Path, whole: memoryview, offsets: list[int]) -> sink.BundleSink:
    s = _open(directory)
    s.write_image(whole, offsets)
    s.finish()
    return s


def test_an_image_segment_is_written_whole_and_the_files_are_the_bundles_byte_for_byte(tmp_path: Path) -> None:
    offsets, size = image.layout(ENTRIES, ROUTES, PARTS)  # type: ignore[misc]
    s = _write_image(tmp_path / "image", _segment(offsets, size), offsets)
    index, data = _files(tmp_path / "image")
    assert (index, data) == _expected(tmp_path)
    # The chunk digests an incremental save's next base needs, as the ordinary path logs them.
    assert {d.key: d.crcs for d in s.digests()} == {"a": (crc32c.crc32c(A),), "w": (crc32c.crc32c(W),)}


def test_a_small_image_is_written_through_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sink, "_DIRECT_MIN_BYTES", 3 * direct.ALIGNMENT)
    monkeypatch.setattr(direct, "DirectWrite", None)  # never made
    offsets, size = image.layout(ENTRIES, ROUTES, PARTS)  # type: ignore[misc]
    _write_image(tmp_path / "small", _segment(offsets, size), offsets)
    assert _files(tmp_path / "small") == _expected(tmp_path)


def test_a_segment_not_laid_out_as_the_image_is_written_part_by_part(tmp_path: Path) -> None:
    offsets, size = [0, 64, 5120, 5184], 8192  # 64-byte aligned, as a policy's segment
    _write_image(tmp_path / "parts", _segment(offsets, size), offsets)
    assert _files(tmp_path / "parts") == _expected(tmp_path)


class _Refusing(direct.DirectWrite):
    """A file system that refuses O_DIRECT at the open, as FUSE and some network file systems do."""

    opened = 0

    def __init__(self, path: str, whole: memoryview) -> None:
        def refuse(p: str, flags: int) -> int:
            _Refusing.opened += 1
            raise OSError(errno.EINVAL, "Invalid argument")

        super().__init__(path, whole, opener=refuse)


def test_where_o_direct_is_refused_the_image_goes_through_the_page_cache_and_is_not_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(direct, "DirectWrite", _Refusing)
    monkeypatch.setattr(sink, "_refused", set())
    offsets, size = image.layout(ENTRIES, ROUTES, PARTS)  # type: ignore[misc]
    with caplog.at_level(logging.INFO, logger=sink.__name__):
        _write_image(tmp_path / "one", _segment(offsets, size), offsets)
        _write_image(tmp_path / "two", _segment(offsets, size), offsets)
    expected = _expected(tmp_path)
    assert _files(tmp_path / "one") == expected and _files(tmp_path / "two") == expected
    assert _Refusing.opened == 1  # the device is remembered
    assert sink._refused == {os.stat(tmp_path).st_dev}  # noqa: SLF001
    assert [r.message for r in caplog.records if "refuses O_DIRECT" in r.message] != []


def test_a_direct_write_of_an_image_not_in_whole_blocks_is_refused_before_it_starts(tmp_path: Path) -> None:
    (tmp_path / "f").touch()
    with pytest.raises(ValueError, match="not whole 4096-byte blocks"):
        direct.DirectWrite(str(tmp_path / "f"), memoryview(mmap.mmap(-1, 4096))[:4000])


@pytest.mark.skipif(not direct.supported(), reason="no O_DIRECT on this platform")
def test_a_direct_write_puts_the_image_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.touch()
    whole = memoryview(mmap.mmap(-1, 3 * direct.ALIGNMENT))
    whole[:] = os.urandom(whole.nbytes)
    written = direct.DirectWrite(str(path), whole).wait()
    assert path.read_bytes() == bytes(whole) if written else path.stat().st_size == 0
