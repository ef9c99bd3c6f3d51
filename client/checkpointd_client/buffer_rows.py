"""Which storage rows of a TF-Agents `TFUniformReplayBuffer` were written between two looks at its cursor.

Pure arithmetic (no TensorFlow), so the rule is tested on its own; what
makes it sound for the real buffer is `checkpointd_client.delta`'s to say.

The buffer (tf_agents/replay_buffers/tf_uniform_replay_buffer.py) keeps
`batch_size` blocks of `max_length` rows in each storage variable of shape
`[batch_size * max_length, ...]`. `add_batch` takes the next id
(`last_id += 1`) and writes row `b * max_length + id % max_length` of every
block `b`, in every data variable and in the id table; `clear()` sets
`last_id` back to -1 (and with `clear_all_variables=True` zeroes every
row). So between two looks with no clear in between, the ids
`before + 1 .. now` were written: per block one run of rows, two where it
wraps past `max_length`, and every row once it moved by `max_length` or
more.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cursor:
    """What a look at a buffer saw: its `last_id`, and how many clears had run by then."""

    last_id: int
    clears: int


def written_rows(before: Cursor, now: Cursor, batch_size: int, max_length: int) -> list[tuple[int, int]] | None:
    """The rows written since `before`, as sorted, disjoint [start, stop) ranges; None if they cannot be bounded.

    None when a clear ran in between (its refill may have rewritten rows
    under the same ids), the cursor went back (a restore or an assign,
    which no look can bound), or it moved by `max_length` or more (every
    row was written: copy them all).

    Raises:
        ValueError: batch_size or max_length is not positive.
    """
    if batch_size < 1 or max_length < 1:
        raise ValueError(f"batch_size and max_length must be >= 1, got {batch_size} and {max_length}")
    moved = now.last_id - before.last_id
    if now.clears != before.clears or moved < 0 or moved >= max_length:
        return None
    if moved == 0:
        return []
    start = (before.last_id + 1) % max_length  # the row of the first new id, within each block
    stop = start + moved
    ranges: list[tuple[int, int]] = []
    for block in range(batch_size):
        base = block * max_length
        if stop <= max_length:
            ranges.append((base + start, base + stop))
        else:  # wrapped: the block's head, then its tail
            ranges += [(base, base + stop - max_length), (base + start, base + max_length)]
    return _merged(ranges)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges with touching ones joined (a block's tail and the next block's head are one copy)."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out
