"""The rows a TFUniformReplayBuffer wrote between two looks at its cursor, against a model of the buffer.

The model writes rows as tf_uniform_replay_buffer.py does (add_batch: the
next id's row `b * max_length + id % max_length` of every block b; clear:
the cursor back to -1, the storage zeroed with clear_all_variables). A
copy kept up to date with `written_rows` (whole where it says None) must
equal the storage at every look. The real buffer, TensorFlow and a daemon
are test_delta_snapshots.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointd_client.buffer_rows import Cursor, written_rows


@dataclass
class ModelBuffer:
    batch_size: int
    max_length: int
    last_id: int = -1
    clears: int = 0
    next_value: int = 1
    storage: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.storage = np.zeros(self.batch_size * self.max_length, np.int64)

    def add_batch(self) -> None:
        self.last_id += 1
        for block in range(self.batch_size):
            self.storage[block * self.max_length + self.last_id % self.max_length] = self.next_value
            self.next_value += 1

    def clear(self, all_variables: bool) -> None:
        self.last_id = -1
        self.clears += 1  # what delta's wrapped _clear counts
        if all_variables:
            self.storage[:] = 0

    def cursor(self) -> Cursor:
        return Cursor(self.last_id, self.clears)


_OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40)),
    st.tuples(st.just("clear"), st.booleans()),
    st.tuples(st.just("save"), st.just(0)),
)


@settings(max_examples=400, deadline=None)
@given(batch_size=st.integers(1, 4), max_length=st.integers(1, 12), ops=st.lists(_OPS, max_size=40))
def test_a_copy_kept_by_the_written_rows_always_equals_the_storage(
    batch_size: int, max_length: int, ops: list[tuple[str, int]]
) -> None:
    buffer = ModelBuffer(batch_size, max_length)
    copy = buffer.storage.copy()  # the first save copies whole
    seen = buffer.cursor()
    for op, arg in [*ops, ("save", 0)]:
        if op == "add":
            for _ in range(arg):
                buffer.add_batch()
        elif op == "clear":
            buffer.clear(bool(arg))
        else:
            rows = written_rows(seen, buffer.cursor(), batch_size, max_length)
            if rows is None:
                copy[:] = buffer.storage
            else:
                for start, stop in rows:
                    copy[start:stop] = buffer.storage[start:stop]
            seen = buffer.cursor()
            np.testing.assert_array_equal(copy, buffer.storage)


@given(
    batch_size=st.integers(1, 5),
    max_length=st.integers(1, 20),
    before=st.integers(-1, 100),
    moved=st.integers(0, 40),
)
def test_the_ranges_are_sorted_disjoint_and_cover_exactly_the_rows_of_the_new_ids(
    batch_size: int, max_length: int, before: int, moved: int
) -> None:
    rows = written_rows(Cursor(before, 0), Cursor(before + moved, 0), batch_size, max_length)
    if moved >= max_length:
        assert rows is None
        return
    assert rows is not None
    covered = [r for start, stop in rows for r in range(start, stop)]
    expected = {
        b * max_length + i % max_length for b in range(batch_size) for i in range(before + 1, before + moved + 1)
    }
    assert covered == sorted(expected)  # each row once, in order
    assert all(a[1] < b[0] for a, b in zip(rows, rows[1:], strict=False))  # disjoint and not touching


def test_a_clear_a_cursor_gone_back_or_a_full_lap_cannot_be_bounded() -> None:
    assert written_rows(Cursor(9, 0), Cursor(9, 1), 2, 100) is None  # cleared and refilled to the same id
    assert written_rows(Cursor(9, 0), Cursor(3, 0), 2, 100) is None  # a restore or an assign
    assert written_rows(Cursor(9, 0), Cursor(109, 0), 2, 100) is None  # every row written
    assert written_rows(Cursor(9, 0), Cursor(9, 0), 2, 100) == []


def test_a_wrap_writes_each_blocks_head_and_tail_and_joins_touching_blocks() -> None:
    # ids 8..11 of max_length 10: rows 8, 9, 0, 1 of each block.
    assert written_rows(Cursor(7, 0), Cursor(11, 0), 2, 10) == [(0, 2), (8, 12), (18, 20)]


def test_a_bad_geometry_is_refused() -> None:
    with pytest.raises(ValueError, match="max_length"):
        written_rows(Cursor(0, 0), Cursor(1, 0), 1, 0)
