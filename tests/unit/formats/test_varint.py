"""Base-128 varints: what protobuf and LevelDB's tables write, read back; truncated or oversized ones refused."""

from __future__ import annotations

import pytest

from checkpointd.protocol import varint


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, b"\x00"),
        (1, b"\x01"),
        (127, b"\x7f"),
        (128, b"\x80\x01"),
        (300, b"\xac\x02"),
        (2**64 - 1, b"\xff" * 9 + b"\x01"),
    ],
)
def test_a_varint_encodes_as_protobuf_does_and_decodes_back(value: int, encoded: bytes) -> None:
    assert varint.encode(value) == encoded
    assert varint.decode(b"\x07" + encoded + b"\x07", 1) == (value, 1 + len(encoded))
    assert varint.decode(memoryview(encoded), 0) == (value, len(encoded))


def test_a_negative_value_is_refused() -> None:
    with pytest.raises(ValueError, match="unsigned"):
        varint.encode(-1)


@pytest.mark.parametrize("data", [b"", b"\x80", b"\xff\xff", b"\xff" * 10 + b"\x01"])
def test_a_truncated_or_oversized_varint_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError, match="past the end"):
        varint.decode(data, 0)
