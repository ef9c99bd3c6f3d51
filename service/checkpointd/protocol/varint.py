"""Base-128 varints, as protobuf and LevelDB's tables write them (`PutVarint64`, `GetVarint64`)."""

from __future__ import annotations

from collections.abc import Sequence

# The one-byte varints, made once: most lengths and counts a table or a proto holds.
_ONE_BYTE = tuple(bytes((n,)) for n in range(0x80))


def encode(value: int) -> bytes:
    """`value` (unsigned, < 2**64) as a little-endian base-128 varint."""
    if 0 <= value < 0x80:
        return _ONE_BYTE[value]
    if value < 0:
        raise ValueError(f"a varint is unsigned, saw {value}")
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode(data: Sequence[int], at: int) -> tuple[int, int]:
    """The varint starting at `data[at]`, and where it ends.

    Raises:
        ValueError: `data` ends inside the varint, or it runs past 64 bits.
    """
    value, shift = 0, 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError(f"a varint runs past the end of its {len(data)} bytes or past 64 bits")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
