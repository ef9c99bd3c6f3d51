"""Standby slots' records (`checkpointd.protocol.standby`): sealed slots read back, torn ones never trusted."""

from __future__ import annotations

import pytest

from checkpointd.protocol import standby


def _slot(sizes: list[int], header: bytes = b"h" * 100) -> tuple[memoryview, int]:
    offset = standby.data_offset_for(len(header))
    return memoryview(bytearray(standby.slot_size(offset, sizes))), offset


def test_a_sealed_slot_reads_back_its_generation_header_and_parts() -> None:
    slot, offset = _slot([5, 0, 3])
    views = standby.part_views(slot, offset, [5, 0, 3])
    views[0][:] = b"abcde"
    views[2][:] = b"xyz"
    standby.seal(slot, 7, b"the header", offset)
    record = standby.read(slot)
    assert record == standby.Record(7, b"the header", offset)
    assert offset % standby.PAGE == 0
    again = standby.part_views(slot, record.data_offset, [5, 0, 3])
    assert [bytes(v) for v in again] == [b"abcde", b"", b"xyz"]


def test_an_invalidated_slot_is_not_trusted_until_sealed_again() -> None:
    slot, offset = _slot([8])
    standby.seal(slot, 1, b"one", offset)
    standby.invalidate(slot)
    assert standby.read(slot) is None
    standby.seal(slot, 2, b"two", offset)
    assert standby.read(slot) == standby.Record(2, b"two", offset)


@pytest.mark.parametrize("at", [9, 17, 20, standby.HEAD + 1])
def test_a_record_changed_anywhere_fails_its_crc(at: int) -> None:
    slot, offset = _slot([8])
    standby.seal(slot, 3, b"a header of some length", offset)
    slot[at] ^= 0x40
    assert standby.read(slot) is None


def test_the_newest_trusted_slot_wins_and_none_when_neither_is() -> None:
    a, b = standby.Record(4, b"", 4096), standby.Record(5, b"", 4096)
    assert standby.newest([a, b]) == (1, b)
    assert standby.newest([b, a]) == (0, b)
    assert standby.newest([None, a]) == (1, a)
    assert standby.newest([None, None]) is None


def test_a_header_too_large_for_the_slot_or_parts_past_its_end_are_refused() -> None:
    slot, offset = _slot([8], header=b"")
    with pytest.raises(ValueError, match="does not fit"):
        standby.seal(slot, 1, b"x" * offset, offset)
    with pytest.raises(ValueError, match="its parts need"):
        standby.part_views(slot, offset, [slot.nbytes])
    assert standby.read(memoryview(bytearray(10))) is None
