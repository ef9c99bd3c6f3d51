"""NumPy state carried with a save: which arrays, and where their bytes sit.

A trainer may save a `tf_agents.utils.numpy_storage.NumpyState` beside its
policy. Unlike the policy's variables it is not part of the run's manifest:
its arrays may change from one save to the next, so each save declares them
in its header, and their bytes follow the variables' in the snapshot. The
daemon writes them as the checkpoint `tf.train.Checkpoint(numpy_arrays=state)`
would write, at `<export_dir>/numpy_state/numpy_state`.

Pure: the object graph is only carried here; `checkpointd.formats.numpy_files` parses
it with TensorFlow's protos.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from checkpointd.core.variable_manifest import Manifest, VariableSpec, check_limit
from checkpointd.protocol.errors import InvalidRequestError

# Relative to the export dir; mirrors SavedModel's variables/variables.
DIRECTORY = "numpy_state"
PREFIX = f"{DIRECTORY}/{DIRECTORY}"
# Every key of a NumpyState checkpoint starts so (the Checkpoint's attribute).
KEY_PREFIX = "numpy_arrays/"


@dataclass(frozen=True)
class NumpyEntry:
    """One array: its checkpoint key and the size of its serialization."""

    checkpoint_key: str
    nbytes: int


@dataclass(frozen=True)
class NumpyStateSpec:
    """The numpy state of one save: its object graph and entries, in payload order."""

    object_graph: bytes
    entries: tuple[NumpyEntry, ...]

    def __post_init__(self) -> None:
        if not self.object_graph:
            raise InvalidRequestError("numpy_state: the object graph is empty")
        seen: set[str] = set()
        for entry in self.entries:
            key = entry.checkpoint_key
            if not key.startswith(KEY_PREFIX):
                raise InvalidRequestError(
                    f"numpy_state: key {key!r} does not start with {KEY_PREFIX!r} "
                    "(save a tf.train.Checkpoint(numpy_arrays=state))"
                )
            if key in seen:
                raise InvalidRequestError(f"numpy_state: key {key!r} appears twice")
            if entry.nbytes < 0:
                raise InvalidRequestError(f"numpy_state: key {key!r} has a negative size")
            seen.add(key)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def offsets(self, start: int) -> list[tuple[int, int]]:
        """(start, end) byte ranges of each entry in a payload whose entries begin at `start`."""
        ranges = []
        for e in self.entries:
            ranges.append((start, start + e.nbytes))
            start += e.nbytes
        return ranges


@dataclass(frozen=True)
class NumpyPayload:
    """A save's numpy state as received: its spec and the entries' bytes, in order."""

    spec: NumpyStateSpec
    data: bytes | bytearray | memoryview

    def __post_init__(self) -> None:
        if memoryview(self.data).nbytes != self.spec.nbytes:
            raise InvalidRequestError(
                f"numpy_state: {memoryview(self.data).nbytes} bytes received for entries " f"of {self.spec.nbytes}"
            )


def check_payload(
    manifest: Manifest,
    declared: Sequence[VariableSpec],
    declared_bytes: int,
    numpy_state: NumpyStateSpec | None,
    max_bytes: int | None = None,
) -> None:
    """Checks a save's declared variables and numpy state against the run's manifest.

    Args:
        manifest: the run's manifest.
        declared: the variables the save's header declares.
        declared_bytes: the header's snapshot size (variables plus numpy state).
        numpy_state: the header's numpy state, or None.
        max_bytes: the daemon's limit on a snapshot, or None.

    Raises:
        InvalidRequestError: naming the first variable that differs (in any
            field, checkpoint_key included), or if the sizes do not add up.
        LimitExceededError: if the whole snapshot is larger than `max_bytes`.
    """
    manifest.check_variables(declared)
    extra = numpy_state.nbytes if numpy_state is not None else 0
    if declared_bytes != manifest.nbytes + extra:
        raise InvalidRequestError(
            f"snapshot declares {declared_bytes} bytes; its variables take {manifest.nbytes} "
            f"and its numpy state {extra}"
        )
    check_limit(declared_bytes, max_bytes)
