"""The policy format: a run's template graph plus a snapshot's values.

`PolicyFormat` implements `checkpointd.core.ports.SaveFormat` for the two kinds
`PolicySaver` writes. Like `checkpointd.formats.policy_template`, which checks
the uploaded templates, it needs no TensorFlow: the protos it reads are
`checkpointd.v1.tf_formats_pb2`, wire-identical with TensorFlow's.

A SAVED_MODEL save copies the template's graph files and writes a new
`variables/` checkpoint holding the snapshot, under the SavedModel's own
checkpoint keys and object graph, then a fingerprint computed from the result.
A CHECKPOINT save writes the `variables/` checkpoint alone, under the keys and
object graph of `PolicySaver.save_checkpoint`. The daemon writes the
`variables/` bundle itself (`checkpointd.bundle`), no SaveV2: the
tensors in the order of the object graph's nodes, which is the order
TensorFlow's own saver uses, so the variable files are byte-identical to
PolicySaver's for the same values. A save is opened before its snapshot
arrives (`open`) and each variable is written where it goes as its bytes
land (`checkpointd.bundle.sink`).
The Store then commits the staged files with `checkpointd.manifest.json`
listing each with its size and CRC32C (template files' sums are known here),
so a crash or a bad disk can be told from a complete save without TensorFlow.

Lock discipline: `_lock` guards `_templates` and `_plans` (each kept
template's bundle layout, made at its first save) only. A write takes the
`Template` its snapshot was checked against (immutable, its files held in
memory) under the lock and then works without it, so registering a new
template never disturbs a write in progress: a save accepted before a run
registered again is written with the template of its accept, never with the
new one's graph or keys. The last few templates of a run are kept for that.
`_register_lock` serializes the on-disk swap of template directories.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

import farmhash

from checkpointd import bundle, durable
from checkpointd.bundle import chunks, sink
from checkpointd.bundle.sink import BundleSink
from checkpointd.core.checkpoint_spec import CheckpointSpec
from checkpointd.core.numpy_state import PREFIX as NUMPY_STATE_PREFIX
from checkpointd.core.numpy_state import NumpyPayload, NumpyStateSpec, check_payload
from checkpointd.core.ports import CommittedSave, SaveValues, SnapshotBytes, Staged
from checkpointd.core.variable_manifest import Manifest, VariableSpec
from checkpointd.formats import numpy_files, policy_template, reader, versions
from checkpointd.formats.policy_template import VARIABLES_PREFIX, Template
from checkpointd.protocol import varint
from checkpointd.protocol.errors import RunNotFoundError, SaveFailedError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import check_run_name
from checkpointd.protocol.tensors import OBJECT_GRAPH_KEY
from checkpointd.v1 import tf_formats_pb2

_LOGGER = logging.getLogger(__name__)


# Templates kept per run, so a save accepted before the run registered again is
# written with its own; a handful covers any real re-registration burst.
_KEPT_TEMPLATES = 4


class PolicyFormat:
    """SavedModels and checkpoints from run templates and snapshots.

    Implements `checkpointd.core.ports.SaveFormat`. Thread-safe.
    """

    kinds = (SaveKind.SAVED_MODEL, SaveKind.CHECKPOINT)

    def __init__(self, state_dir: Path, *, fsync: bool = True) -> None:
        """Creates the format.

        Args:
            state_dir: The daemon's own folder; templates live in
                `state_dir/templates/<run>/`.
            fsync: Whether to fsync templates before publishing them.
        """
        self._templates_dir = Path(state_dir) / "templates"
        self._fsync = fsync
        self._lock = threading.Lock()
        self._register_lock = threading.Lock()
        # Each run's recent templates, newest last (see _KEPT_TEMPLATES).
        self._templates: dict[str, list[Template]] = {}
        # Each kept template's bundle layout by kind (`_plan`), by the template's id (it holds a dict: unhashable).
        self._plans: dict[tuple[int, SaveKind], tuple[Template, _Plan]] = {}

    def register(
        self,
        run: str,
        staged_dir: Path,
        variables: Sequence[VariableSpec],
        checkpoint_object_graph: bytes,
    ) -> Manifest:
        """Validates an uploaded PolicySaver.save() output and makes it the run's template.

        The template is checked by parsing its files, not by loading the
        model. `staged_dir` is consumed: moved into the state dir on success,
        deleted on failure.

        Args:
            run: The run name.
            staged_dir: The uploaded SavedModel.
            variables: The variables of every snapshot, in snapshot order.
            checkpoint_object_graph: The serialized TrackableObjectGraph that
                PolicySaver.save_checkpoint writes for the policy.

        Returns:
            The run's manifest: `variables`, in order.

        Raises:
            InvalidRequestError: the template is not a TF-Agents policy
                SavedModel, or `variables` or the object graph disagree with it.
            OSError: the template could not be moved into the state dir.
        """
        staged_dir = Path(staged_dir)
        try:
            check_run_name(run)
            template = policy_template.validate(run, staged_dir, Manifest(tuple(variables)), checkpoint_object_graph)
            with self._register_lock:
                target = self._templates_dir / run
                tmp = durable.make_temp_sibling(target)
                tmp.rmdir()
                shutil.move(staged_dir, tmp)
                try:
                    durable.publish_dir(tmp, target, fsync=self._fsync)
                except BaseException:
                    durable.remove_quietly(tmp)
                    raise
                with self._lock:
                    kept = self._templates.setdefault(run, [])
                    kept.append(template)
                    for dropped in kept[:-_KEPT_TEMPLATES]:
                        for k in self.kinds:
                            self._plans.pop((id(dropped), k), None)
                    del kept[:-_KEPT_TEMPLATES]
        except BaseException:
            durable.remove_quietly(staged_dir)
            raise
        _LOGGER.debug(
            "run %s: registered a template of %d variables (%d bytes a snapshot)",
            run,
            len(template.manifest.variables),
            template.manifest.nbytes,
        )
        return template.manifest

    def write(
        self,
        run: str,
        kind: SaveKind,
        manifest: Manifest,
        staging: Path,
        snapshot: SnapshotBytes,
        numpy_state: NumpyPayload | None,
        *,
        checkpoint: CheckpointSpec | None = None,  # training checkpoints only: never given here
    ) -> Staged:
        """Writes one save's files into the empty dir `staging`, from a snapshot in memory.

        Args:
            run: A registered run.
            kind: SAVED_MODEL (PolicySaver.save) or CHECKPOINT
                (PolicySaver.save_checkpoint).
            manifest: The run's manifest the snapshot was checked against.
            staging: The empty dir to write into.
            snapshot: Every variable's raw little-endian C-order bytes,
                concatenated in manifest order, or one buffer per variable.
            numpy_state: A NumpyState to write beside the variables, as
                `numpy_state/numpy_state` (see checkpointd.formats.numpy_files).

        Raises:
            RunNotFoundError: the run has no template.
            SaveFailedError: the snapshot does not fit the template.
            OSError: the files could not be written (the pipeline reports
                them as SaveFailedError with the reason).
        """
        template = self._template(run, manifest)
        pieces = sink.split(snapshot, [v.nbytes for v in template.manifest.variables], f"run {run!r}", "the manifest")
        tail = numpy_state.data if numpy_state is not None else b""
        parts = [memoryview(p).nbytes for p in pieces] + [memoryview(tail).nbytes]
        spec = numpy_state.spec if numpy_state is not None else None
        with self.open(run, kind, manifest, staging, parts, spec) as opened:
            return sink.feed(opened, [*pieces, tail])

    def open(
        self,
        run: str,
        kind: SaveKind,
        manifest: Manifest,
        staging: Path,
        parts: Sequence[int],
        numpy_state: NumpyStateSpec | None,
        *,
        checkpoint: CheckpointSpec | None = None,  # training checkpoints only: never given here
    ) -> BundleSink:
        """Opens one save's files in the empty dir `staging`; the sink takes the snapshot as it arrives.

        A SAVED_MODEL save's template files are written now; the variables'
        bundle (`variables/variables.*`) takes each variable where it goes
        in data order (the object graph's), its object graph written now;
        the numpy state's bytes (the last part) are kept and written, with
        the index and fingerprint.pb, when the sink finishes.

        Args:
            parts: each variable's size in manifest order, then the numpy
                state's (0 without).

        Raises:
            RunNotFoundError: the run has no template.
            SaveFailedError: the parts do not fit the template.
            OSError: the files could not be created.
        """
        template = self._template(run, manifest)
        tail = numpy_state.nbytes if numpy_state is not None else 0
        plan = self._plan(template, kind)
        if len(parts) != len(plan.parts) + 1 or tuple(parts[:-1]) != plan.parts or parts[-1] != tail:
            raise SaveFailedError(f"run {run!r}: snapshot parts do not match the manifest")
        where = os.fspath(staging)
        if kind is SaveKind.SAVED_MODEL:
            for rel in template.dirs:
                _mkdir(os.path.join(where, rel))
            for rel, content in template.files:
                durable.write_new(os.path.join(where, rel), content)
        _mkdir(os.path.join(where, "variables"))
        finish = functools.partial(self._finish, template, kind, staging, numpy_state)

        def finish_with_digests(index: bytes, tail: bytes) -> Staged:
            # The next save's base: the variables' chunk digests, and the data file committing renames.
            staged = finish(index, tail)
            record = chunks.record(_DATA_FILE, os.stat(os.path.join(where, _DATA_PATH)), opened.digests())
            return dataclasses.replace(staged, extra={**(staged.extra or {}), chunks.FIELD: record})

        opened = BundleSink(
            os.path.join(where, VARIABLES_PREFIX), plan.entries, plan.routes, parts, finish_with_digests,
            strings=plan.strings,
        )  # fmt: skip
        return opened

    def _plan(self, template: Template, kind: SaveKind) -> _Plan:
        """The bundle layout of `template`'s saves of `kind`, made at its first save and kept with it."""
        with self._lock:
            held = self._plans.get((id(template), kind))
        if held is not None and held[0] is template:
            return held[1]
        plan = _make_plan(template, kind)
        with self._lock:
            if any(t is template for kept in self._templates.values() for t in kept):  # not dropped meanwhile
                self._plans[(id(template), kind)] = (template, plan)
        return plan

    def _template(self, run: str, manifest: Manifest) -> Template:
        """The template a save was checked against: the registration whose manifest it is."""
        with self._lock:
            kept = list(self._templates.get(run, ()))
        if not kept:
            raise RunNotFoundError(f"run {run!r} has no template on this daemon; register it first")
        template = next((t for t in reversed(kept) if t.manifest is manifest), None)
        if template is None:
            raise SaveFailedError(
                f"run {run!r} was registered again {_KEPT_TEMPLATES} times while this save was in flight; save again"
            )
        return template

    def _finish(
        self,
        template: Template,
        kind: SaveKind,
        staging: Path,
        numpy_state: NumpyStateSpec | None,
        index: bytes,
        tail: bytes,
    ) -> Staged:
        """The files written after the variables' bundle: fingerprint.pb (SAVED_MODEL) and the numpy state."""
        written, known = _sizes(template, kind, staging, index)
        extra = None
        if numpy_state is not None:
            written += numpy_files.write(staging, NumpyPayload(numpy_state, tail))
            extra = {
                "numpy_state": {
                    "prefix": NUMPY_STATE_PREFIX,
                    "keys": [e.checkpoint_key for e in numpy_state.entries],
                }
            }
        return Staged(
            path=staging,
            bytes_written=written,
            versions=versions.recorded(),
            known=known,
            extra=extra,
        )

    def check(
        self,
        manifest: Manifest,
        variables: Sequence[VariableSpec],
        snapshot_bytes: int,
        numpy_state: NumpyStateSpec | None,
        max_snapshot_bytes: int,
        *,
        checkpoint: CheckpointSpec | None = None,  # training checkpoints only: never given here
    ) -> None:
        """Refuses a save header that does not fit the run's manifest (see `check_payload`)."""
        check_payload(manifest, variables, snapshot_bytes, numpy_state, max_snapshot_bytes)
        if numpy_state is not None:
            numpy_files.check(numpy_state)  # parses the object graph (checkpointd.formats.object_graph)

    def read(self, save: CommittedSave, manifest: Manifest) -> SaveValues:
        """Opens a committed policy save for Restore (see `checkpointd.formats.reader`)."""
        return reader.open_save(Path(save.path), save.kind, manifest, repr(save.export_dir))


_DATA_PATH = VARIABLES_PREFIX + bundle.DATA_SUFFIX  # in the save's dir
_DATA_FILE = "/" + _DATA_PATH  # as a save's chunk record names it


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What every save of one template and kind writes alike: its bundle's tensors and where each part goes."""

    parts: tuple[int, ...]  # each variable's bytes, in manifest order (the numpy state's part follows)
    entries: tuple[bundle.Entry, ...]  # the bundle's tensors in data order: the variables, then the object graph
    routes: tuple[int | None, ...]  # each wire part's entry; None for the numpy state, kept for finish
    strings: dict[int, bytes]  # the object graph, by its entry


def _make_plan(template: Template, kind: SaveKind) -> _Plan:
    variables = template.manifest.variables
    if kind is SaveKind.SAVED_MODEL:
        order, names, graph = template.saved_model_order, [v.key for v in variables], template.saved_model_graph
    elif kind is SaveKind.CHECKPOINT:
        order, names = template.checkpoint_order, [v.checkpoint_key for v in variables]
        graph = template.checkpoint_graph
    else:
        raise SaveFailedError(f"unknown save kind {kind!r}")
    entries = [bundle.Entry(names[i], variables[i].dtype, variables[i].shape, variables[i].nbytes) for i in order]
    entries.append(bundle.string_entry(OBJECT_GRAPH_KEY, graph))
    position = {i: at for at, i in enumerate(order)}
    routes: list[int | None] = [position[j] for j in range(len(variables))]
    routes.append(None)
    return _Plan(tuple(v.nbytes for v in variables), tuple(entries), tuple(routes), {len(order): graph})


def _mkdir(path: str) -> None:
    """`Path(path).mkdir(exist_ok=True)`, without pathlib's parsing."""
    try:
        os.mkdir(path)
    except FileExistsError:
        if not os.path.isdir(path):
            raise


def _sizes(
    template: Template, kind: SaveKind, tmp: Path, index: bytes
) -> tuple[int, dict[str, tuple[int, int]] | None]:
    """Writes a SAVED_MODEL's fingerprint.pb; returns the size of the save's files so far.

    Returns:
        Their total size, and the (size, CRC32C) of those whose bytes were in
        memory here (a SAVED_MODEL's template files, fingerprint.pb and the
        index it hashes), so that the manifest need not read them back.
    """
    if kind is SaveKind.SAVED_MODEL:
        fingerprint = _fingerprint(template, index)
        durable.write_new(os.path.join(tmp, "fingerprint.pb"), fingerprint)
        known = dict(template.checksums)
        for rel, content in (("fingerprint.pb", fingerprint), ("variables/variables.index", index)):  # manifest paths
            known[rel] = policy_template.size_and_crc(content)
        # Every file is in `known` but the data shards, the only ones to stat.
        with os.scandir(os.path.join(tmp, "variables")) as entries:
            shards = sum(e.stat(follow_symlinks=False).st_size for e in entries if f"variables/{e.name}" not in known)
        return sum(size for size, _ in known.values()) + shards, known
    written = sum(
        os.path.getsize(os.path.join(dirpath, name)) for dirpath, _, filenames in os.walk(tmp) for name in filenames
    )
    return written, None


def _fingerprint(template: Template, index: bytes) -> bytes:
    """The written SavedModel's fingerprint.pb: the template's, with the save's own checkpoint_hash.

    What TensorFlow's `CreateFingerprintDef(tmp)` returns, byte for byte, at a
    fraction of its cost (it parses and hashes the whole graph, for
    fields that depend on saved_model.pb alone, which every save copies from
    the template): checkpoint_hash is TF's `HashCheckpointIndexFile`, the
    farmhash Fingerprint64 of `variables/variables.index` (`index`, as
    written), computed here by farmhash's own C++ (pyfarmhash) rather than
    TensorFlow's Fingerprint op: the op's eager dispatch lets go of the GIL
    and waits to get it back behind every busy thread, per save. The
    template's other fields are serialized once (`_fingerprint_around`); a
    save adds its hash between them as protobuf would.
    """
    value = farmhash.fingerprint64(index)
    before, after = _fingerprint_around(template.fingerprint)
    # proto3 leaves a zero out; otherwise field 5 (varint): its tag, then the value.
    return before + (_CHECKPOINT_HASH_TAG + varint.encode(value) if value else b"") + after


_CHECKPOINT_HASH_TAG = bytes([5 << 3])  # FingerprintDef.checkpoint_hash = 5, wire type 0 (varint)
_MARK = 0x0123456789ABCDEF  # a checkpoint_hash whose encoding is found once in the serialized template


@functools.lru_cache(maxsize=1024)
def _fingerprint_around(template_fingerprint: bytes) -> tuple[bytes, bytes]:
    """A template's fingerprint.pb serialized without its checkpoint_hash: the bytes before and after the field.

    Serialized by protobuf itself with a marker value in the field, then cut
    around it: fields go out in field-number order, so the marker's tag and
    varint sit where any save's value goes.
    """
    fingerprint = tf_formats_pb2.FingerprintDef.FromString(template_fingerprint)
    fingerprint.checkpoint_hash = _MARK
    data = fingerprint.SerializeToString()
    mark = _CHECKPOINT_HASH_TAG + varint.encode(_MARK)
    at = data.find(mark)
    if at < 0 or data.find(mark, at + 1) >= 0:
        raise SaveFailedError(
            "the template's fingerprint.pb cannot be rewritten: its checkpoint_hash is not found once"
        )
    return data[:at], data[at + len(mark) :]
