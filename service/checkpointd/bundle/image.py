"""A bundle's data file as an image in memory: where each snapshot part goes so the image is the file.

A snapshot in shared memory is written to disk fastest with O_DIRECT
(`checkpointd.durable.direct`), straight from the segment's pages; the
kernel takes that only in whole aligned blocks, at the same alignment in
memory and in the file. A bundle's tensors lie back to back at offsets of
no alignment, so the segment is laid out as an image of the data file:
each part at its tensor's own offset (a scalar string's value after its
length and the length's checksum, which the daemon writes into the image
later, as it does the strings it knows at open), and the image rounded up
to whole blocks. The image is then the file byte for byte, and is written
whole and cut to the file's size. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from checkpointd.bundle.writer import Entry, data_offsets
from checkpointd.durable.direct import ALIGNMENT, round_up
from checkpointd.protocol.tensors import STRING


def layout(
    entries: Sequence[Entry], routes: Sequence[int | None], parts: Sequence[int]
) -> tuple[list[int], int] | None:
    """Each part's offset in an image of the data file of `entries`, and the image's size (whole blocks).

    Args:
        entries: the bundle's tensors, in data order.
        routes: for each part, the data-order index of its tensor, or None
            for a tail the data file does not hold.
        parts: each part's size in bytes.

    Returns:
        None when a part has no place in the image: a tail of some bytes,
        or a string tensor that is not a scalar of the part's bytes.
    """
    offsets = data_offsets(entries)
    end = offsets[-1] + entries[-1].size if entries else 0
    out = []
    for route, size in zip(routes, parts, strict=True):
        if route is None:
            if size:
                return None
            out.append(end)
            continue
        entry = entries[route]
        if entry.dtype == STRING:
            # A scalar string's value is the last bytes of its entry, after its length and checksum.
            if entry.shape or size > entry.size:
                return None
            out.append(offsets[route] + entry.size - size)
        else:
            out.append(offsets[route])
    return out, round_up(end, ALIGNMENT)
