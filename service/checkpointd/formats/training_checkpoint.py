"""The training-checkpoint format: whatever a tf.train.Checkpoint saves, written with no template.

`TrainingFormat` implements `checkpointd.core.ports.SaveFormat` for
TRAINING_CHECKPOINT saves. The trainer's client computes, with TensorFlow's
own saver code, what `tf.train.Checkpoint.write` would write (every tensor's
checkpoint key, dtype, shape and bytes, in the saver's order, and the
serialized object graph) and sends it with each save. Here:

- `check` parses the object graph and refuses, before the decision, a save
  whose tensors are not exactly the graph's attributes, whose Python state is
  not a string, whose sizes do not add up or pass --max-snapshot-bytes;
- `open` (and `write`, for a snapshot in memory) writes the tensors under
  those keys, in the order sent, then the object graph, as the tensor bundle
  `ckpt.index` + `ckpt.data-00000-of-00001` in the staging dir
  (`checkpointd.bundle`: each tensor written as its bytes arrive);
  the Store commits them as `<dir>/ckpt-<step>.*` beside the dir's other
  checkpoints (`Staged.files_prefix`). The bundle is byte for byte what one
  SaveV2 call writes, and one SaveV2 call on one host device is what
  TensorFlow's MultiDeviceSaver does for a single-device trainer, so the
  files are those of `Checkpointer.save` for the same values;
- `read` opens a committed checkpoint for Restore, checked against its own
  object graph, and lists what it holds.

No model code, no registration state: a new trackable type needs nothing
here, and no TensorFlow: a committed checkpoint is read back by
`checkpointd.bundle.reader`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from checkpointd import bundle
from checkpointd.bundle import chunks, image, sink
from checkpointd.bundle.reader import BundleReader, CorruptBundleError, UnreadableBundleError
from checkpointd.bundle.sink import BundleSink
from checkpointd.core.checkpoint_spec import CheckpointSpec, TensorSpec, check_dtypes, check_keys
from checkpointd.core.numpy_state import NumpyPayload, NumpyStateSpec
from checkpointd.core.ports import CommittedSave, SnapshotBytes, Staged
from checkpointd.core.variable_manifest import Manifest, VariableSpec
from checkpointd.formats import object_graph, versions
from checkpointd.protocol import tensors
from checkpointd.protocol.errors import (
    ChecksumError,
    InvalidRequestError,
    SaveFailedError,
    describe,
)
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import check_run_name

# The staged files' stem: `ckpt.index`, `ckpt.data-00000-of-00001`. The
# Store renames them to the save's own prefix when it commits them.
STAGED_STEM = "ckpt"
# The manifest field this format adds (CommittedSave.extra): the dir's
# CheckpointManager rules as this save set them, for retention.
EXTRA_FIELD = "training_checkpoint"


class TrainingFormat:
    """Training checkpoints from per-save tensor lists. Stateless, so thread-safe.

    Implements `checkpointd.core.ports.SaveFormat`.
    """

    kinds = (SaveKind.TRAINING_CHECKPOINT,)

    def register(
        self,
        run: str,
        staged_dir: Path,
        variables: Sequence[VariableSpec],
        checkpoint_object_graph: bytes,
    ) -> Manifest:
        """Registers a training run: there is no template, so nothing may come with it.

        Raises:
            InvalidRequestError: the registration carried variables, an object
                graph or template files.
        """
        try:
            check_run_name(run)
            if variables or checkpoint_object_graph:
                raise InvalidRequestError(
                    f"run {run!r}: a TRAINING_CHECKPOINT run registers no variables and no object graph; "
                    "each save carries its own (SaveHeader.training_checkpoint)"
                )
            if staged_dir.exists() and any(staged_dir.iterdir()):
                raise InvalidRequestError(f"run {run!r}: a TRAINING_CHECKPOINT run uploads no template files")
        finally:
            shutil.rmtree(staged_dir, ignore_errors=True)
        return Manifest(())

    def check(
        self,
        manifest: Manifest,
        variables: Sequence[VariableSpec],
        snapshot_bytes: int,
        numpy_state: NumpyStateSpec | None,
        max_snapshot_bytes: int,
        *,
        checkpoint: CheckpointSpec | None = None,
    ) -> None:
        """Refuses a training checkpoint header that does not add up, before the decision.

        Raises:
            InvalidRequestError: no training_checkpoint, policy fields set, a
                size that does not add up, or tensors that are not exactly the
                object graph's attributes (naming the first key).
            LimitExceededError: the checkpoint is over --max-snapshot-bytes.
        """
        if checkpoint is None:
            raise InvalidRequestError("a TRAINING_CHECKPOINT save needs its training_checkpoint (the tensors)")
        if variables or numpy_state is not None:
            raise InvalidRequestError(
                "a TRAINING_CHECKPOINT save carries its tensors in training_checkpoint; variables must be "
                "empty and numpy_state unset"
            )
        checkpoint.check(snapshot_bytes, max_snapshot_bytes)
        pairs = graph_attributes(checkpoint.object_graph, "training_checkpoint's object graph")
        check_keys(checkpoint.keys, pairs)
        check_dtypes(checkpoint, pairs)

    def write(
        self,
        run: str,
        kind: SaveKind,
        manifest: Manifest,
        staging: Path,
        snapshot: SnapshotBytes,
        numpy_state: NumpyPayload | None,
        *,
        checkpoint: CheckpointSpec | None = None,
    ) -> Staged:
        """Writes the checkpoint's files into the empty dir `staging` from a snapshot in memory.

        Args:
            snapshot: one buffer per tensor (`checkpoint.tensors` order), or
                their concatenation.
            checkpoint: the save's checked description.

        Raises:
            SaveFailedError: the snapshot does not fit the description.
            OSError: the files could not be written.
        """
        if checkpoint is None or kind is not SaveKind.TRAINING_CHECKPOINT:
            raise SaveFailedError(f"run {run!r}: the training format writes TRAINING_CHECKPOINT saves only")
        pieces = sink.split(
            snapshot, [t.nbytes for t in checkpoint.tensors], f"run {run!r}", "the training checkpoint's tensors"
        )
        parts = [*(p.nbytes for p in pieces), 0]
        with self.open(run, kind, manifest, staging, parts, None, checkpoint=checkpoint) as opened:
            return sink.feed(opened, [*pieces, b""])

    def open(
        self,
        run: str,
        kind: SaveKind,
        manifest: Manifest,
        staging: Path,
        parts: Sequence[int],
        numpy_state: NumpyStateSpec | None,
        *,
        checkpoint: CheckpointSpec | None = None,
    ) -> BundleSink:
        """Opens the checkpoint's bundle in the empty dir `staging`; the sink takes each tensor as it arrives.

        Args:
            parts: each tensor's size (`checkpoint.tensors` order), then 0.
            checkpoint: the save's checked description.

        Raises:
            SaveFailedError: not a training checkpoint, or parts that do not fit it.
            OSError: the files could not be created.
        """
        if checkpoint is None or kind is not SaveKind.TRAINING_CHECKPOINT or numpy_state is not None:
            raise SaveFailedError(f"run {run!r}: the training format writes TRAINING_CHECKPOINT saves only")
        entries, routes = _bundle_of(run, parts, checkpoint)
        rules, count = checkpoint.retention, len(checkpoint.tensors)

        def finish(index: bytes, tail: bytes) -> Staged:
            data = staging / (STAGED_STEM + bundle.DATA_SUFFIX)
            return Staged(
                path=staging,
                bytes_written=sum(f.stat().st_size for f in staging.iterdir()),
                versions=versions.recorded(),
                extra={
                    EXTRA_FIELD: {
                        "max_to_keep": rules.max_to_keep,
                        "keep_checkpoint_every_n_hours": rules.keep_checkpoint_every_n_hours,
                        "tensors": count,
                    },
                    # The next save's base: committing renames the file, which keeps its identity.
                    chunks.FIELD: chunks.record(bundle.DATA_SUFFIX, data.stat(), opened.digests()),
                },
                files_prefix=STAGED_STEM,
            )

        opened = BundleSink(
            staging / STAGED_STEM, entries, routes, parts, finish, strings={len(entries) - 1: checkpoint.object_graph}
        )
        return opened

    def segment_layout(
        self, parts: Sequence[int], *, checkpoint: CheckpointSpec | None = None
    ) -> tuple[list[int], int] | None:
        """Each part's offset in a shared-memory segment that is an image of the data file, and its size.

        Implements `checkpointd.core.ports.SegmentLayouts` (`checkpointd.bundle.image`).

        Raises:
            SaveFailedError: not a training checkpoint, or parts that do not fit it.
        """
        if checkpoint is None:
            raise SaveFailedError("the training format lays out TRAINING_CHECKPOINT saves only")
        entries, routes = _bundle_of("", parts, checkpoint)
        return image.layout(entries, routes, parts)

    def read(self, save: CommittedSave, manifest: Manifest) -> TrainingValues:
        """Opens a committed training checkpoint for Restore.

        Raises:
            InvalidRequestError: its tensors are not exactly its object graph's,
                or one has a dtype the wire cannot carry (naming the key).
            ChecksumError, SaveFailedError: its files are corrupt or unreadable.
        """
        where = repr(save.export_dir)
        try:
            reader = BundleReader(save.path.name, below=os.fspath(save.path.parent))  # no link below its dir followed
            shapes = {key: t.shape for key, t in reader.tensors.items()}
            dtypes = {key: t.dtype for key, t in reader.tensors.items()}
            graph = reader.string(tensors.OBJECT_GRAPH_KEY) if tensors.OBJECT_GRAPH_KEY in shapes else b""
        except CorruptBundleError as e:
            raise ChecksumError(f"{where}: its checkpoint is corrupt ({describe(e)})") from None
        except UnreadableBundleError as e:
            raise SaveFailedError(f"{where}: its checkpoint is unreadable ({describe(e)})") from None
        if not graph:
            raise InvalidRequestError(f"{where}: the checkpoint has no {tensors.OBJECT_GRAPH_KEY}")
        pairs = graph_attributes(graph, f"{where}'s object graph")
        stored = [k for k in shapes if k != tensors.OBJECT_GRAPH_KEY]
        try:
            check_keys(stored, pairs)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{where}: {e}") from None
        specs, strings = [], {}
        for key, _ in pairs:
            dtype = dtypes[key]
            if tensors.is_string(dtype):
                if shapes[key]:
                    raise InvalidRequestError(f"{where}: {key!r} is a string tensor of shape {list(shapes[key])}")
                strings[key] = _read(reader, key, where, string=True)
                specs.append(TensorSpec(key, tensors.STRING, (), len(strings[key])))
            elif dtype in tensors.ITEMSIZE:
                shape = shapes[key]
                specs.append(TensorSpec(key, dtype, shape, tensors.nbytes(dtype, shape)))
            else:
                raise InvalidRequestError(f"{where}: {key!r} has dtype {dtype}, which Restore cannot carry")
        spec = CheckpointSpec(graph, tuple(specs))
        return TrainingValues(spec, None, spec.nbytes, reader, strings, where)


@dataclass
class TrainingValues:
    """A committed training checkpoint, opened: what it holds, and its values on demand."""

    checkpoint: CheckpointSpec
    numpy_state: NumpyStateSpec | None
    nbytes: int
    _reader: BundleReader
    _strings: dict[str, bytes]
    _where: str

    def pieces(self) -> Iterator[memoryview]:
        """Each tensor's bytes in `checkpoint.tensors` order, one tensor in memory at a time.

        Raises:
            ChecksumError, SaveFailedError: a tensor is corrupt or unreadable.
        """
        for t in self.checkpoint.tensors:
            if tensors.is_string(t.dtype):
                yield memoryview(self._strings[t.checkpoint_key])
            else:
                yield memoryview(_read(self._reader, t.checkpoint_key, self._where))


def _bundle_of(
    run: str, parts: Sequence[int], checkpoint: CheckpointSpec
) -> tuple[list[bundle.Entry], list[int | None]]:
    """The bundle's entries (data order: the tensors, then the object graph) and each part's route to them.

    Raises:
        SaveFailedError: the parts are not the tensors' sizes then 0.
    """
    if list(parts) != [*(t.nbytes for t in checkpoint.tensors), 0]:
        raise SaveFailedError(f"run {run!r}: snapshot parts do not match the training checkpoint's tensors")
    entries = [
        bundle.Entry(t.checkpoint_key, tensors.STRING, (), bundle.string_size([t.nbytes]))
        if tensors.is_string(t.dtype)
        else bundle.Entry(t.checkpoint_key, t.dtype, t.shape, t.nbytes)
        for t in checkpoint.tensors
    ]
    entries.append(bundle.string_entry(tensors.OBJECT_GRAPH_KEY, checkpoint.object_graph))
    return entries, [*range(len(checkpoint.tensors)), None]


def graph_attributes(data: bytes, what: str) -> list[tuple[str, str]]:
    """(checkpoint key, attribute name) of every attribute of a serialized object graph, in node order.

    Raises:
        InvalidRequestError: the graph does not parse.
    """
    graph = object_graph.parse(data, what)
    return [(key, name) for node in graph.nodes for name, key in node.attributes]


def _read(reader: BundleReader, key: str, where: str, *, string: bool = False) -> bytes:
    """A tensor's value bytes (a scalar string's value with `string`), its CRC32C checked."""
    try:
        return reader.string(key) if string else reader.raw(key)
    except CorruptBundleError as e:
        raise ChecksumError(f"{where}: {key!r} is corrupt ({describe(e)})") from None
    except UnreadableBundleError as e:
        raise SaveFailedError(f"{where}: could not read {key!r} ({describe(e)})") from None
