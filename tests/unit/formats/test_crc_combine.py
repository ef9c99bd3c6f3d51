"""formats/crc.py: a concatenation's CRC32C from its pieces' CRCs matches summing the bytes."""

from __future__ import annotations

import random

import crc32c
import pytest

from checkpointd.bundle.crc import combine


@pytest.mark.parametrize("seed", range(5))
def test_combine_matches_the_concatenations_crc(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        a = rng.randbytes(rng.randrange(0, 200))
        b = rng.randbytes(rng.randrange(0, 5000))
        assert combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_chunks_folded_one_by_one_give_the_wholes_crc() -> None:
    rng = random.Random(7)
    data = rng.randbytes(1 << 16)
    crc, at = 0, 0
    for size in (1, 4096, 4096, 333, 0, 20000):
        piece = data[at : at + size]
        crc = combine(crc, crc32c.crc32c(piece), len(piece))
        at += size
    assert crc == crc32c.crc32c(data[:at])


def test_empty_second_piece_keeps_the_first_crc() -> None:
    assert combine(0x1234ABCD, 0, 0) == 0x1234ABCD


def test_negative_length_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        combine(1, 2, -1)
