"""Delta snapshots: a save copies into the shared-memory segment only what changed since the segment's last snapshot.

A same-host `RemoteCheckpointer` copies each save's values into the run's
segment (`checkpointd_client.transport.shm`). The segment still holds the previous
snapshot when the next save is accepted: the daemon only reads it, one
save of a run is in flight at a time, the trainer writes it only between
the accept and its `shared_memory_written`, and the daemon lets go of it
(`checkpointd.transport.shm.SharedMemory.release`) after that save's commit,
before its lane takes the next. So a save need not copy the bytes that
are already there.

The rule. Every tensor is copied whole (the agent's weights, optimizer
slots, counters, Python state), except the storage of a replay buffer
whose writes since the segment's snapshot are bounded: of those, only the
rows its write cursor moved over (`checkpointd_client.buffer_rows`),
gathered from the variable (a dense read of a table TensorFlow has put in
copy-on-read mode, as its scatter writes do, would copy all of it). The
agent's large variables are copied whole too: a training step changes
all of them, and nothing short of a compare (as costly as the copy) says
which bytes did not. Everything is copied whole when the segment's
content is not known to be this checkpointer's last snapshot of this
layout: the first copy of the process, another segment (a new path or a
new map: the daemon made, evicted or remade it), a layout change, another
checkpointer of this process having written the segment since, or the
previous copy having raised part way. Assumed, not checked: no other
process writes the run's segment between two saves (a run is one
trainer's: `<job>.<ckpt_dir>`, and the daemon offers the segment only to
the save it accepted; a restarted trainer's first copy is whole).

Which buffers, and what is assumed of them. A buffer's rows are bounded
only if it is exactly TF-Agents' `TFUniformReplayBuffer` over its own
`table.Table`s (a subclass or another table may write elsewhere), in
eager mode, and this checkpointer saw its cursor at the segment's last
snapshot. TF-Agents writes its storage and cursor in two places only:
`_add_batch` (takes the next id and writes that id's row of every block,
data and id table, `buffer_rows` gives the arithmetic) and `_clear` (sets
the cursor to -1, and zeroes the storage with `clear_all_variables`).
A clear followed by enough adds brings the cursor back to where it was
with every row rewritten, which the cursor cannot show, so clears are
counted: the buffer's `_clear` is wrapped (on that instance) to add one to
a counter variable of this module's, which is not part of the checkpoint,
and any clear between two snapshots copies the buffer whole. The wrap is
made when the checkpointer is built (or first sees the buffer, whose
save then copies it whole), so it counts every later clear, eager or in
a `tf.function` traced after it. Not seen, and assumed not to happen
after the checkpointer is built: a clear inside a `tf.function` traced
before it, and writes to the storage other than add_batch and clear (a
`restore()` into the buffer from another Checkpoint, an `assign` to its
variables, an add_batch on another thread during the save, which breaks
a full copy's point in time as well). A cursor that went back (a
restore, an assign) or moved by `max_length` or more also copies whole.
A trainer restarted from a checkpoint restores at construction, before
its first save, which copies whole.

Other buffers (TF-Agents' NumPy buffers, whose state is Python state
serialized at the call, Reverb, a buffer type not known here) are copied
whole, as before.

Over gRPC (no segment) the same rule copies into the buffers of the
previous upload (`checkpointd_client.training_saves`: they come back once
that save is durable, holding its snapshot), and what a copy wrote
(`SnapshotCopy.written`) lets an incremental upload whose base is that
very save skip summing the chunks nobody wrote
(`checkpointd.protocol.increments`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf
from tensorflow.python.checkpoint import graph_view
from tf_agents.replay_buffers import table, tf_uniform_replay_buffer

from checkpointd_client.buffer_rows import Cursor, written_rows
from checkpointd_client.tf_checkpoint import TrainingState
from checkpointd_client.transport.shm import SegmentMap

_LOGGER = logging.getLogger(__name__)

# Each wrapped buffer's clear counter: one per buffer, however many checkpointers save it.
_CLEARS: weakref.WeakKeyDictionary[Any, tf.Variable] = weakref.WeakKeyDictionary()
# Segment path -> the deltas that last copied into it in this process.
_WRITERS: weakref.WeakValueDictionary[str, SegmentDeltas] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class SnapshotCopy:
    """What one save copied into the shared-memory segment (or a gRPC save's buffers).

    `whole` says why the replay buffers' storage was copied whole (None:
    only the rows written since the segment's last snapshot were).
    `written`: per tensor, the byte ranges copied over the previous
    snapshot, sorted (None: copied whole); empty when nothing was known.
    """

    bytes_copied: int
    nbytes: int
    whole: str | None
    written: tuple[tuple[tuple[int, int], ...] | None, ...] = ()


@dataclass(frozen=True, eq=False)  # by identity: a key of _Held.cursors
class _Buffer:
    """A TFUniformReplayBuffer of the state whose writes can be bounded, and where its storage is in the state."""

    buffer: weakref.ref[Any]
    indices: tuple[int, ...]  # its storage tensors' indices in the state
    batch_size: int
    max_length: int
    clears: tf.Variable

    def cursor(self) -> Cursor | None:
        buffer = self.buffer()
        if buffer is None:
            return None
        return Cursor(int(buffer._last_id.numpy()), int(self.clears.numpy()))  # noqa: SLF001 - see the module doc


@dataclass(frozen=True)
class _Held:
    """What the segment holds: this layout's snapshot, with each buffer's cursor at its copy."""

    segment: weakref.ref[Any]  # the SegmentMap, or a gRPC save's buffers
    layout: tuple[Any, ...]
    cursors: dict[_Buffer, Cursor]  # each buffer's cursor then


class SegmentDeltas:
    """One checkpointer's copies into its shared-memory segment: whole, or only what changed.

    Not thread-safe: a checkpointer copies one save at a time (the daemon
    accepts one save of a run at a time, and the copy precedes the upload).
    """

    def __init__(self, run: str, root: Any = None) -> None:
        """Wraps the clears of `root`'s replay buffers now, before training traces them.

        Args:
            run: the checkpointer's run, for the log.
            root: the tf.train.Checkpoint saved (None: buffers are wrapped when first seen).
        """
        self._run = run
        self._held: _Held | None = None
        self._lost = "the first copy into this segment"  # why nothing is known of the segment
        self._buffers: tuple[tuple[Any, ...], tuple[_Buffer, ...]] | None = None  # (layout, buffers)
        self.last: SnapshotCopy | None = None
        if root is not None and tf.executing_eagerly():
            for buffer in _known_buffers(root):
                _clears(buffer)

    def copy(self, root: Any, state: TrainingState, segment: SegmentMap, views: Sequence[memoryview]) -> SnapshotCopy:
        """Copies `state` into `segment`'s `views` (one per tensor): what changed since its last snapshot, or all.

        Raises:
            Whatever the copy raises; the next copy is then whole.
        """
        self.copy_parts(root, state, segment, views, strings=True)
        assert self.last is not None
        return self.last

    def copy_parts(
        self, root: Any, state: TrainingState, into: Any, views: Sequence[memoryview], *, strings: bool
    ) -> list[memoryview]:
        """Copies `state` into `views`, the buffers of `into` (a segment, or any object owning them); the parts.

        `into` is compared by identity with the last copy's: the same object
        holds that snapshot's bytes unless something else wrote them (a
        segment: another checkpointer of this process, see the module doc).
        `strings`: as `TrainingState.copy`. `self.last` says what was copied.

        Raises:
            Whatever the copy raises; the next copy is then whole.
        """
        held, self._held = self._held, None  # until this copy completes, the buffers' content is unknown
        try:
            buffers = self._buffers_of(root, state)
            cursors = {b: b.cursor() for b in buffers}
            rows, whole = self._rows(held, state, into, buffers, cursors)
            parts = state.copy(views, strings=strings, rows=rows)
        except BaseException:
            self._lost = "the previous copy into the segment did not complete"
            raise
        known = {key: cursor for key, cursor in cursors.items() if cursor is not None}
        self._held = _Held(weakref.ref(into), state.layout, known)
        if isinstance(into, SegmentMap):
            _WRITERS[into.path] = self
        row_bytes = [t.nbytes // max(1, t.shape[0]) if t.shape else t.nbytes for t in state.tensors]
        written = tuple(
            tuple((start * row_bytes[i], stop * row_bytes[i]) for start, stop in rows[i]) if i in rows else None
            for i in range(len(state.tensors))
        )
        skipped = sum(state.tensors[i].nbytes for i, ranges in rows.items())
        copied = sum(stop - start for ranges in written if ranges is not None for start, stop in ranges)
        self.last = SnapshotCopy(state.nbytes - skipped + copied, state.nbytes, whole, written if rows else ())
        _LOGGER.debug(
            "run %s: copied %d of the snapshot's %d bytes into the shared-memory segment (%s)",
            self._run, self.last.bytes_copied, state.nbytes,
            "the rows written since its last snapshot" if whole is None else f"whole: {whole}",
        )  # fmt: skip
        return parts

    def _rows(
        self,
        held: _Held | None,
        state: TrainingState,
        segment: Any,
        buffers: tuple[_Buffer, ...],
        cursors: dict[_Buffer, Cursor | None],
    ) -> tuple[dict[int, list[tuple[int, int]]], str | None]:
        """Tensor index -> the rows to copy, for each buffer whose writes are bounded; and why any was not."""
        if not buffers:
            return {}, "no replay buffer whose writes are bounded"
        if held is None:
            return {}, self._lost
        if held.segment() is not segment:
            return {}, "another segment"
        if isinstance(segment, SegmentMap) and _WRITERS.get(segment.path) is not self:
            return {}, "another checkpointer of this process copied into the segment"
        if held.layout != state.layout:
            return {}, "the layout changed"
        rows: dict[int, list[tuple[int, int]]] = {}
        whole: str | None = None
        for b in buffers:
            before, now = held.cursors.get(b), cursors[b]
            written = None
            if before is not None and now is not None:
                written = written_rows(before, now, b.batch_size, b.max_length)
            if written is None:
                whole = whole or _why(before, now, b.max_length)
                continue
            for i in b.indices:
                rows[i] = written
        return rows, whole

    def _buffers_of(self, root: Any, state: TrainingState) -> tuple[_Buffer, ...]:
        """The state's bounded buffers: found again when the layout or a storage variable changed."""
        cached = self._buffers
        if cached is not None and cached[0] == state.layout and all(_still(b, state) for b in cached[1]):
            return cached[1]
        found: list[_Buffer] = []
        if tf.executing_eagerly():
            index = {id(t.source): i for i, t in enumerate(state.tensors) if isinstance(t.source, tf.Variable)}
            for buffer in _known_buffers(root):
                storage = _storage(buffer)
                capacity = int(buffer._capacity_value)  # noqa: SLF001 - see the module doc
                if all(id(v) in index and v.shape.rank and v.shape[0] == capacity for v in storage):
                    indices = tuple(index[id(v)] for v in storage)
                    found.append(
                        _Buffer(
                            weakref.ref(buffer), indices, int(buffer._batch_size),  # noqa: SLF001
                            int(buffer._max_length), _clears(buffer),  # noqa: SLF001
                        )
                    )  # fmt: skip
        self._buffers = (state.layout, tuple(found))
        return self._buffers[1]


def _why(before: Cursor | None, now: Cursor | None, max_length: int) -> str:
    if before is None or now is None:
        return "a replay buffer not seen at the segment's last snapshot"
    if now.clears != before.clears:
        return "a replay buffer was cleared"
    if now.last_id < before.last_id:
        return "a replay buffer's cursor went back"
    return f"a replay buffer's cursor moved by {now.last_id - before.last_id} >= its max_length {max_length}"


def _still(b: _Buffer, state: TrainingState) -> bool:
    """Whether `b`'s storage variables are still the state's tensors at its indices."""
    buffer = b.buffer()
    if buffer is None:
        return False
    storage = _storage(buffer)
    return len(storage) == len(b.indices) and all(
        state.tensors[i].source is v for i, v in zip(b.indices, storage, strict=True)
    )


def _storage(buffer: Any) -> list[tf.Variable]:
    return list(buffer._data_table.variables()) + list(buffer._id_table.variables())  # noqa: SLF001


def _known_buffers(root: Any) -> list[Any]:
    """Every TFUniformReplayBuffer under `root` that writes its storage only as the module doc says."""
    objects, _ = graph_view.ObjectGraphView(root).breadth_first_traversal()
    out = []
    for o in objects:
        if (
            type(o) is tf_uniform_replay_buffer.TFUniformReplayBuffer
            and type(o._data_table) is table.Table  # noqa: SLF001
            and type(o._id_table) is table.Table  # noqa: SLF001
            and not {"_add_batch", "_increment_last_id", "_get_rows_for_id"} & vars(o).keys()
            and ("_clear" not in vars(o) or o in _CLEARS)
        ):
            out.append(o)
    return out


def _clears(buffer: Any) -> tf.Variable:
    """The buffer's clear counter, wrapping its `_clear` (this instance's) the first time."""
    counter = _CLEARS.get(buffer)
    if counter is not None:
        return counter
    with tf.init_scope():
        counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="checkpointd_clears")
    original = buffer._clear  # noqa: SLF001

    def counted_clear(*args: Any, **kwargs: Any) -> Any:
        cleared = original(*args, **kwargs)
        counted = counter.assign_add(1)
        # Traced (a tf.function, a TF1 graph): the count runs with the clear.
        return cleared if tf.executing_eagerly() else tf.group(cleared, counted)

    # Not an attribute TensorFlow tracks: a Python function is no trackable.
    buffer._clear = counted_clear  # noqa: SLF001
    _CLEARS[buffer] = counter
    return counter
