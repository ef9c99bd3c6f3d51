"""checkpointd.bundle.sink: a snapshot's wire parts routed into a tensor bundle as they arrive."""

from __future__ import annotations

import threading
from pathlib import Path

import crc32c
import pytest

from checkpointd import bundle
from checkpointd.bundle import sink, table
from checkpointd.core.ports import Staged
from checkpointd.protocol.errors import InvalidRequestError, SaveFailedError


def _sink(tmp_path: Path, finished: list[tuple[bytes, bytes]]) -> sink.BundleSink:
    # Wire order: w (float32 x2), py (a string), b (uint8 x3), then a tail. Data order: b, py, w, graph.
    entries = [
        bundle.Entry("b", "uint8", (3,), 3),
        bundle.Entry("py", "string", (), bundle.string_size([5])),
        bundle.Entry("w", "float32", (2,), 8),
        bundle.string_entry("graph", b"G"),
    ]

    def finish(index: bytes, tail: bytes) -> Staged:
        finished.append((index, tail))
        return Staged(path=tmp_path, bytes_written=0, versions={})

    return sink.BundleSink(tmp_path / "x", entries, [2, 1, 0, None], [8, 5, 3, 4], finish, strings={3: b"G"})


def test_parts_in_any_order_land_where_the_data_order_puts_them(tmp_path: Path) -> None:
    finished: list[tuple[bytes, bytes]] = []
    with _sink(tmp_path, finished) as s:
        s.write(2, 0, b"abc")  # b, before the first variable on the wire
        s.write(0, 0, b"\x01" * 4)
        s.write(3, 0, b"ta")
        s.write(1, 0, b"pyt")
        s.write(0, 4, b"\x02" * 4)
        s.write(1, 3, b"ho")
        s.write(3, 2, b"il")
        s.finish()
    ((index, tail),) = finished
    assert tail == b"tail"  # kept whole for the format's own file
    expected = bundle.write(
        tmp_path / "y",
        [
            bundle.Entry("b", "uint8", (3,), 3),
            bundle.string_entry("py", b"pytho"),
            bundle.Entry("w", "float32", (2,), 8),
            bundle.string_entry("graph", b"G"),
        ],
        [b"abc", [b"pytho"], b"\x01" * 4 + b"\x02" * 4, [b"G"]],
    )
    assert index == expected
    data = (tmp_path / ("x" + bundle.DATA_SUFFIX)).read_bytes()
    assert data == (tmp_path / ("y" + bundle.DATA_SUFFIX)).read_bytes()
    assert data.startswith(b"abc")  # b first, as in data order


def test_out_of_order_bytes_within_a_part_are_refused(tmp_path: Path) -> None:
    with _sink(tmp_path, []) as s:
        s.write(0, 0, b"\x00" * 4)
        with pytest.raises(InvalidRequestError, match="offset 2 of part #0"):
            s.write(0, 2, b"\x00" * 2)
        with pytest.raises(InvalidRequestError, match="within their size"):
            s.write(2, 0, b"\x00" * 4)


def test_an_incomplete_snapshot_does_not_finish(tmp_path: Path) -> None:
    finished: list[tuple[bytes, bytes]] = []
    with _sink(tmp_path, finished) as s:
        s.write(0, 0, b"\x00" * 8)
        with pytest.raises(InvalidRequestError, match="part #1 ended after 0 of its 5"):
            s.finish()
    assert finished == [] and not (tmp_path / ("x" + bundle.INDEX_SUFFIX)).exists()


def test_writes_after_close_fail_and_close_waits_for_a_write_in_progress(tmp_path: Path) -> None:
    s = _sink(tmp_path, [])
    s.write(0, 0, b"\x00" * 4)
    entered, release = threading.Event(), threading.Event()
    real_write = s._writer.write  # noqa: SLF001 - holding a write in progress

    def slow_write(i: int, data: object, crc: int | None = None) -> None:
        entered.set()
        release.wait(10)
        real_write(i, data, crc)

    s._writer.write = slow_write  # type: ignore[method-assign]  # noqa: SLF001
    errors: list[BaseException] = []

    def write() -> None:
        try:
            s.write(0, 4, b"\x07" * 4)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    assert entered.wait(10)
    closer = threading.Thread(target=s.close)
    closer.start()  # while the write holds the file
    release.set()
    writer.join(10)
    closer.join(10)
    # Had close not waited, the write would have found its file closed.
    assert errors == [] and not closer.is_alive()
    data = (tmp_path / ("x" + bundle.DATA_SUFFIX)).read_bytes()
    assert data[13:21] == b"\x00" * 4 + b"\x07" * 4  # w, after b (3 bytes) and py (10)
    with pytest.raises(ValueError, match="closed"):
        s.write(1, 0, b"p")


def test_parts_that_disagree_with_the_entries_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="takes 3"):
        sink.BundleSink(tmp_path / "z", [bundle.Entry("b", "uint8", (3,), 3)], [0], [4], lambda i, t: None)  # type: ignore[arg-type, return-value]


def test_split_gives_one_view_per_part_or_names_the_mismatch() -> None:
    views = sink.split(b"abcdef", [2, 0, 4], "run 'r'", "the manifest")
    assert [bytes(v) for v in views] == [b"ab", b"", b"cdef"]
    with pytest.raises(SaveFailedError, match="snapshot has 6 bytes; the manifest needs 7"):
        sink.split(b"abcdef", [7], "run 'r'", "the manifest")
    with pytest.raises(SaveFailedError, match="parts do not match the manifest"):
        sink.split([memoryview(b"ab")], [3], "run 'r'", "the manifest")


def test_a_string_part_is_written_once_complete_with_its_crc(tmp_path: Path) -> None:
    finished: list[tuple[bytes, bytes]] = []
    with _sink(tmp_path, finished) as s:
        for part, offset, data in ((0, 0, b"\x00" * 8), (2, 0, b"abc"), (1, 0, b"py"), (1, 2, b"tho"), (3, 0, b"tail")):
            s.write(part, offset, data)
        s.finish()
    data = (tmp_path / ("x" + bundle.DATA_SUFFIX)).read_bytes()
    head = b"\x05" + table.mask(crc32c.crc32c(b"\x05\x00\x00\x00")).to_bytes(4, "little")
    assert data[3 : 3 + 10] == head + b"pytho"


def test_checked_chunk_crcs_give_the_same_index_as_summing_the_bytes(tmp_path: Path) -> None:
    summed: list[tuple[bytes, bytes]] = []
    combined: list[tuple[bytes, bytes]] = []
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    chunks = [(2, 0, b"abc"), (0, 0, b"\x01\x07\x09\x00"), (0, 4, b"\x02" * 4), (1, 0, b"pytho"), (3, 0, b"tail")]
    with _sink(tmp_path / "a", summed) as s:
        for part, offset, data in chunks:
            s.write(part, offset, data)
        s.finish()
    with _sink(tmp_path / "b", combined) as s:
        for part, offset, data in chunks:
            s.write(part, offset, data, crc32c.crc32c(data))
        s.finish()
    assert combined[0][0] == summed[0][0]
    whole = table.mask(crc32c.crc32c(b"\x01\x07\x09\x00" + b"\x02" * 4))
    assert b"\x35" + whole.to_bytes(4, "little") in combined[0][0]  # w's entry: the whole tensor's checksum


def test_whole_parts_are_written_in_data_order_and_give_the_same_files(tmp_path: Path) -> None:
    finished: list[tuple[bytes, bytes]] = []
    order: list[int] = []
    with _sink(tmp_path, finished) as s:
        s.watch(lambda start, end: order.append(start))
        order.clear()  # the graph, written at open
        s.write_parts([memoryview(b"\x01" * 8), memoryview(b"pytho"), memoryview(b"abc"), memoryview(b"tail")])
        s.finish()
    ((index, tail),) = finished
    assert tail == b"tail"
    assert order == sorted(order)  # the data file grew from its start: b, then py, then w
    expected = bundle.write(
        tmp_path / "y",
        [
            bundle.Entry("b", "uint8", (3,), 3),
            bundle.string_entry("py", b"pytho"),
            bundle.Entry("w", "float32", (2,), 8),
            bundle.string_entry("graph", b"G"),
        ],
        [b"abc", [b"pytho"], b"\x01" * 8, [b"G"]],
    )
    assert index == expected
    assert (tmp_path / ("x" + bundle.DATA_SUFFIX)).read_bytes() == (tmp_path / ("y" + bundle.DATA_SUFFIX)).read_bytes()


def test_whole_parts_must_be_every_part(tmp_path: Path) -> None:
    with _sink(tmp_path, []) as s, pytest.raises(InvalidRequestError, match="3 parts given whole; the snapshot has 4"):
        s.write_parts([memoryview(b"\x01" * 8), memoryview(b"pytho"), memoryview(b"abc")])


def test_the_staged_save_knows_the_bundle_files_size_and_crc(tmp_path: Path) -> None:
    big = bytes(range(256)) * (8 << 10)  # 2 MiB: two tensors are few enough to combine the data file's CRC
    entries = [bundle.Entry("big", "uint8", (len(big),), len(big)), bundle.string_entry("graph", b"G")]

    def finish(index: bytes, tail: bytes) -> Staged:
        return Staged(path=tmp_path, bytes_written=0, versions={})

    with sink.BundleSink(tmp_path / "x", entries, [0, None], [len(big), 0], finish, strings={1: b"G"}) as s:
        s.write(0, 0, big[:1000])
        s.write(0, 1000, big[1000:], crc32c.crc32c(big[1000:]))  # a checked chunk's CRC, combined
        staged = s.finish()
    assert staged.known is not None
    for suffix in (bundle.DATA_SUFFIX, bundle.INDEX_SUFFIX):
        content = (tmp_path / ("x" + suffix)).read_bytes()
        assert staged.known["x" + suffix] == (len(content), crc32c.crc32c(content))


def test_a_bundle_of_many_small_tensors_leaves_its_data_file_to_the_manifest(tmp_path: Path) -> None:
    entries = [bundle.Entry(f"k{i:04d}", "uint8", (1,), 1) for i in range(3)]

    def finish(index: bytes, tail: bytes) -> Staged:
        return Staged(path=tmp_path, bytes_written=0, versions={}, known={"other": (1, 2)})

    with sink.BundleSink(tmp_path / "x", entries, [0, 1, 2, None], [1, 1, 1, 0], finish) as s:
        s.write_parts([memoryview(b"a"), memoryview(b"b"), memoryview(b"c"), memoryview(b"")])
        staged = s.finish()
    assert staged.known is not None
    assert set(staged.known) == {"other", "x" + bundle.INDEX_SUFFIX}  # 3 tensors in 3 bytes: read back instead
