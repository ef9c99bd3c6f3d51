"""CRC32C of a concatenation from its pieces' CRCs: crc(A ‖ B) from crc(A), crc(B) and len(B).

The receiver checks every chunk's CRC32C as it lands; a tensor's checksum is
the CRC32C of its chunks one after another. Combining the chunks' checked
CRCs gives it without reading the bytes a second time. The arithmetic is
zlib's `crc32_combine` (multiplication modulo the polynomial in GF(2), and
x^(8·n) by repeated squaring) over CRC32C's reflected polynomial; the
operator for a length is computed once and kept (chunks mostly share one
length). Stdlib only.
"""

from __future__ import annotations

import functools

# CRC32C's (Castagnoli) polynomial, bit-reflected.
_POLY = 0x82F63B78
_TOP = 1 << 31  # x^0 in the reflected representation


def _multmodp(a: int, b: int) -> int:
    """a(x) · b(x) modulo the polynomial (both reflected)."""
    product = 0
    m = _TOP
    while True:
        if a & m:
            product ^= b
            if not a & (m - 1):
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _squares() -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial, k = 0..31."""
    out = [_TOP >> 1]  # x^1
    for _ in range(31):
        out.append(_multmodp(out[-1], out[-1]))
    return tuple(out)


_X2N = _squares()


@functools.lru_cache(maxsize=64)
def _shift(nbytes: int) -> int:
    """x^(8·nbytes) modulo the polynomial: what moves a CRC past `nbytes` more bytes."""
    product, n, k = _TOP, nbytes, 3
    while n:
        if n & 1:
            product = _multmodp(_X2N[k & 31], product)
        n >>= 1
        k += 1
    return product


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC32C of A ‖ B, given crc32c(A), crc32c(B) and B's length in bytes.

    Raises:
        ValueError: `len_b` is negative.
    """
    if len_b < 0:
        raise ValueError(f"a length cannot be negative, saw {len_b}")
    if not len_b:
        return crc_a
    return _multmodp(_shift(len_b), crc_a) ^ crc_b
