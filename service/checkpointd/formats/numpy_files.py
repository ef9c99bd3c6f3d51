"""NumpyState checkpoints on disk: check what a trainer declared, write it, read it back.

A save's numpy state becomes `<export_dir>/numpy_state/numpy_state.{index,
data-00000-of-00001}`: byte for byte the checkpoint that
`tf.train.Checkpoint(numpy_arrays=state).write(prefix)` writes in the trainer,
written by the daemon's own bundle writer (`checkpointd.bundle`).
Each array is a scalar string tensor holding NumPy's `.npy` serialization (what
`NumpyState`'s PythonState produces), under its checkpoint key, written in the
order of the object graph's attributes (TensorFlow's saver order), then the
object graph itself. The daemon never parses the arrays.

It is read back by `checkpointd.bundle.reader`, each tensor's CRC32C checked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from checkpointd import bundle
from checkpointd.bundle.reader import BundleReader
from checkpointd.core.numpy_state import PREFIX, NumpyEntry, NumpyPayload, NumpyStateSpec
from checkpointd.durable import dirs
from checkpointd.formats import object_graph
from checkpointd.protocol.errors import InvalidRequestError
from checkpointd.protocol.tensors import OBJECT_GRAPH_KEY

# The attribute name TensorFlow gives a PythonState's serialization.
_PY_STATE = "py_state"


@dataclass(frozen=True)
class NumpyStateRead:
    """A save's numpy state as read back: the spec and each entry's bytes, in order."""

    spec: NumpyStateSpec
    values: tuple[bytes, ...]


def graph_keys(data: bytes) -> list[str]:
    """The checkpoint keys of an object graph's attributes, in TensorFlow's saver order.

    Raises:
        InvalidRequestError: the graph does not parse, or holds state other
            than PythonState (a NumpyState's arrays are its only attributes).
    """
    what = "numpy_state: the object graph"
    return object_graph.attribute_keys(
        object_graph.parse(data, what),
        _PY_STATE,
        what,
        "only NumpyState arrays (PythonState) may be saved as numpy state",
    )


def check(spec: NumpyStateSpec) -> None:
    """Checks that a save's declared entries are exactly its object graph's, in order.

    Raises:
        InvalidRequestError: naming the first key where they differ.
    """
    keys = graph_keys(spec.object_graph)
    declared = [e.checkpoint_key for e in spec.entries]
    # Pairs up what both have; a length mismatch is reported below, after these.
    for i, (want, got) in enumerate(zip(keys, declared, strict=False)):
        if want != got:
            raise InvalidRequestError(f"numpy_state: entry #{i} is {got!r}; the object graph has {want!r} there")
    if len(keys) != len(declared):
        first = keys[len(declared)] if len(keys) > len(declared) else declared[len(keys)]
        raise InvalidRequestError(
            f"numpy_state: {len(declared)} entries for {len(keys)} arrays in the object graph "
            f"(first unmatched: {first!r})"
        )


def write(save_dir: Path, payload: NumpyPayload) -> int:
    """Writes the numpy state checkpoint into a save's (temp) dir.

    Args:
        save_dir: the save being written.
        payload: the checked spec and the entries' bytes, in order.

    Returns:
        The size of the files written, in bytes.

    Raises:
        OSError: the files could not be written.
    """
    prefix = Path(save_dir) / PREFIX
    prefix.parent.mkdir()
    data = memoryview(payload.data)
    values = [bytes(data[start:end]) for start, end in payload.spec.offsets(0)]
    values.append(payload.spec.object_graph)
    names = [e.checkpoint_key for e in payload.spec.entries] + [OBJECT_GRAPH_KEY]
    bundle.write(prefix, [bundle.string_entry(k, v) for k, v in zip(names, values, strict=True)], [[v] for v in values])
    return sum(f.stat().st_size for f in prefix.parent.iterdir())


def read(save_dir: Path) -> NumpyStateRead | None:
    """Reads a save's numpy state back; None if the save has none.

    Nothing below `save_dir` is followed: a link there is InvalidRequestError.

    Raises:
        InvalidRequestError: the checkpoint's keys disagree with its object
            graph, or a link is in its files' way.
        UnreadableBundleError: the files are unreadable (CorruptBundleError: corrupt).
    """
    try:
        os.close(dirs.open_file(os.fspath(save_dir), f"{PREFIX}{bundle.INDEX_SUFFIX}"))
    except FileNotFoundError:
        return None
    except (OSError, dirs.Moved):
        pass  # there, but not as written: the reader says how
    reader = BundleReader(PREFIX, below=os.fspath(save_dir))
    if OBJECT_GRAPH_KEY not in reader.tensors:
        raise InvalidRequestError(f"the numpy state of {save_dir} has no {OBJECT_GRAPH_KEY}")
    graph = reader.string(OBJECT_GRAPH_KEY)
    keys = graph_keys(graph)
    stored = set(reader.tensors) - {OBJECT_GRAPH_KEY}
    if stored != set(keys):
        first = min(stored.symmetric_difference(keys))
        raise InvalidRequestError(f"the numpy state of {save_dir} does not match its object graph at {first!r}")
    values = tuple(reader.string(k) for k in keys)
    spec = NumpyStateSpec(graph, tuple(NumpyEntry(k, len(v)) for k, v in zip(keys, values, strict=True)))
    return NumpyStateRead(spec, values)
