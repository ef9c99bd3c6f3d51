"""The TensorFlow writer: a run's template graph plus a snapshot's values.

The only module of the daemon that imports tensorflow, and only inside
functions, so importing it (and `checkpointd --help`) stays fast.

A SAVED_MODEL save copies the template's graph files and writes a new
`variables/` checkpoint holding the snapshot, under the SavedModel's own
checkpoint keys and object graph, then a fingerprint computed from the result.
A CHECKPOINT save writes the `variables/` checkpoint alone, under the keys and
object graph of `PolicySaver.save_checkpoint`. Tensors are written in the order
of the object graph's nodes, which is the order TensorFlow's own saver uses, so
the variable files are byte-identical to PolicySaver's for the same values.
Last, `checkpointd.manifest.json` (see `checkpointd.verify`) lists every file
with its size and CRC32C, so a crash or a bad disk can be told from a
complete save without TensorFlow.

Lock discipline: `_lock` guards `_templates` only. A write takes the run's
`_Template` (immutable, its files held in memory) under the lock and then works
without it, so registering a new template never disturbs a write in progress.
`_register_lock` serializes the on-disk swap of template directories.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

from checkpointd import __version__, numpy_files, publish, verify
from checkpointd.core.errors import (
    CheckpointdError,
    InvalidRequestError,
    RunNotFoundError,
    SaveFailedError,
)
from checkpointd.core.lane import SaveKind
from checkpointd.core.manifest import Manifest, VariableSpec
from checkpointd.core.numpy_state import PREFIX as NUMPY_STATE_PREFIX
from checkpointd.core.numpy_state import NumpyPayload
from checkpointd.core.paths import check_run_name

_LOGGER = logging.getLogger(__name__)

_OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
_VARIABLE_ATTRIBUTE = "VARIABLE_VALUE"
_REQUIRED_SIGNATURES = ("action", "get_initial_state", "get_train_step", "get_metadata")
_VARIABLES_PREFIX = os.path.join("variables", "variables")
# Written anew for every SAVED_MODEL save, never copied from the template.
_NOT_COPIED = ("variables", "fingerprint.pb")


@dataclass(frozen=True)
class _Template:
    """What write() needs of a run's template; never changed once made."""

    manifest: Manifest
    dirs: tuple[str, ...]  # relative dirs to create, parents first (e.g. "assets")
    files: tuple[tuple[str, bytes], ...]  # relative path, content
    saved_model_graph: bytes  # the SavedModel checkpoint's object graph
    checkpoint_graph: bytes  # PolicySaver.save_checkpoint's object graph
    saved_model_order: tuple[int, ...]  # manifest indexes in SavedModel key order
    checkpoint_order: tuple[int, ...]  # manifest indexes in checkpoint key order
    checksums: dict[str, tuple[int, int]]  # files' (size, CRC32C), for save manifests


class TfWriter:
    """Writes SavedModels and checkpoints from run templates and snapshots.

    Implements `checkpointd.core.ports.Writer`. Thread-safe.
    """

    def __init__(self, state_dir: Path, *, fsync: bool = True) -> None:
        """Creates a writer.

        Args:
            state_dir: The daemon's own folder; templates live in
                `state_dir/templates/<run>/`.
            fsync: Whether to fsync written trees before publishing them.
        """
        self._templates_dir = Path(state_dir) / "templates"
        self._fsync = fsync
        self._lock = threading.Lock()
        self._register_lock = threading.Lock()
        self._templates: dict[str, _Template] = {}

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
            template = _validate(
                run, staged_dir, Manifest(tuple(variables)), checkpoint_object_graph
            )
            with self._register_lock:
                target = self._templates_dir / run
                tmp = publish.make_temp_sibling(target)
                tmp.rmdir()
                shutil.move(staged_dir, tmp)
                try:
                    publish.publish_dir(tmp, target, fsync=self._fsync)
                except BaseException:
                    publish.remove_quietly(tmp)
                    raise
                with self._lock:
                    self._templates[run] = template
        except BaseException:
            publish.remove_quietly(staged_dir)
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
        target: Path,
        snapshot: bytes | bytearray | memoryview,
        *,
        step: int = -1,
        export_dir: str | None = None,
        numpy_state: NumpyPayload | None = None,
    ) -> int:
        """Writes one save atomically to `target`, its save manifest last.

        Args:
            run: A registered run.
            kind: SAVED_MODEL (PolicySaver.save) or CHECKPOINT
                (PolicySaver.save_checkpoint).
            target: The export dir; an existing directory there is replaced.
            snapshot: Every variable's raw little-endian C-order bytes,
                concatenated in manifest order.
            step: The trainer's step, recorded in the save manifest.
            export_dir: The export dir as the trainer named it, for the
                save manifest; default `target.name`.
            numpy_state: A NumpyState to write beside the variables, as
                `<target>/numpy_state/numpy_state` (see checkpointd.numpy_files).

        Returns:
            The total size of the files written, in bytes.

        Raises:
            RunNotFoundError: the run has no template.
            SaveFailedError: the save could not be written; nothing new is
                left on disk.
        """
        with self._lock:
            template = self._templates.get(run)
        if template is None:
            raise RunNotFoundError(f"run {run!r} has no template on this daemon; register it first")
        target = Path(target)
        size = memoryview(snapshot).nbytes
        if size != template.manifest.nbytes:
            raise SaveFailedError(
                f"run {run!r}: snapshot has {size} bytes; the manifest needs "
                f"{template.manifest.nbytes}"
            )
        tmp: Path | None = None
        try:
            tmp = publish.make_temp_sibling(target)
            written = _write_tree(template, kind, tmp, snapshot)
            extra = None
            if numpy_state is not None:
                written += numpy_files.write(tmp, numpy_state)
                extra = {
                    "numpy_state": {
                        "prefix": NUMPY_STATE_PREFIX,
                        "keys": [e.checkpoint_key for e in numpy_state.spec.entries],
                    }
                }
            written += verify.write_manifest(
                tmp,
                run=run,
                kind=kind.value,
                step=step,
                export_dir=target.name if export_dir is None else export_dir,
                versions=_versions(),
                known=template.checksums if kind is SaveKind.SAVED_MODEL else None,
                extra=extra,
            )
            publish.publish_dir(tmp, target, fsync=self._fsync)
        except Exception as e:
            if tmp is not None:
                publish.remove_quietly(tmp)
            if isinstance(e, CheckpointdError):
                raise
            reason = f"could not write {kind.value} to {target}: {_describe(e)}"
            _LOGGER.warning("run %s: %s", run, reason)
            raise SaveFailedError(f"run {run!r}: {reason}") from e
        _LOGGER.debug("run %s: wrote %s to %s (%d bytes)", run, kind.value, target, written)
        return written


@functools.cache
def _versions() -> dict[str, str]:
    """Versions recorded in save manifests; tf-agents only if it is installed here."""
    import tensorflow as tf

    versions = {"checkpointd": __version__, "tensorflow": tf.__version__}
    try:
        versions["tf_agents"] = importlib.metadata.version("tf-agents")
    except importlib.metadata.PackageNotFoundError:
        pass
    return versions


def _describe(e: BaseException) -> str:
    """A one-line reason for an OS or TensorFlow error."""
    if isinstance(e, OSError) and e.strerror:
        where = f" ({e.filename})" if e.filename else ""
        return f"{e.strerror}{where}"
    message = getattr(e, "message", None) or str(e) or type(e).__name__
    return message.strip().splitlines()[0]


def _invalid(run: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"template of run {run!r}: {what}")


def _validate(run: str, staged_dir: Path, manifest: Manifest, checkpoint_graph: bytes) -> _Template:
    """Checks an uploaded template against the manifest; returns its _Template."""
    import tensorflow as tf
    from google.protobuf import message, text_format
    from tensorflow.core.protobuf import saved_model_pb2, struct_pb2

    if not staged_dir.is_dir():
        raise _invalid(run, "is not a directory")
    dirs, files = _read_tree(run, staged_dir)
    contents = dict(files)

    if "saved_model.pb" not in contents:
        raise _invalid(run, "has no saved_model.pb; upload the output of PolicySaver.save()")
    try:
        saved_model = saved_model_pb2.SavedModel.FromString(contents["saved_model.pb"])
    except message.DecodeError as e:
        raise _invalid(run, f"saved_model.pb is not a SavedModel ({e})") from None
    if len(saved_model.meta_graphs) != 1:
        raise _invalid(
            run, f"saved_model.pb has {len(saved_model.meta_graphs)} meta graphs, expected 1"
        )
    signatures = saved_model.meta_graphs[0].signature_def
    missing = [name for name in _REQUIRED_SIGNATURES if name not in signatures]
    if missing:
        raise _invalid(
            run,
            f"saved_model.pb lacks the signature(s) {', '.join(map(repr, missing))}; "
            "is it a TF-Agents policy saved with PolicySaver.save()?",
        )

    if "policy_specs.pbtxt" not in contents:
        raise _invalid(run, "has no policy_specs.pbtxt; upload PolicySaver.save()'s output")
    try:
        text_format.Parse(
            contents["policy_specs.pbtxt"].decode("utf-8"), struct_pb2.StructuredValue()
        )
    except (text_format.ParseError, UnicodeDecodeError) as e:
        raise _invalid(run, f"policy_specs.pbtxt does not parse ({e})") from None

    try:
        reader = tf.train.load_checkpoint(str(staged_dir / _VARIABLES_PREFIX))
        shapes = reader.get_variable_to_shape_map()
        dtypes = reader.get_variable_to_dtype_map()
        saved_model_graph = (
            reader.get_tensor(_OBJECT_GRAPH_KEY) if _OBJECT_GRAPH_KEY in shapes else None
        )
    except (tf.errors.OpError, ValueError) as e:
        _LOGGER.debug("run %s: template checkpoint unreadable: %s", run, _describe(e))
        raise _invalid(
            run,
            "variables/variables.index and .data-00000-of-00001 are missing or unreadable; "
            "upload the whole output of PolicySaver.save()",
        ) from None
    if saved_model_graph is None:
        raise _invalid(run, f"variables/ has no {_OBJECT_GRAPH_KEY} tensor")

    want = {v.key for v in manifest.variables}
    have = set(shapes) - {_OBJECT_GRAPH_KEY}
    if have - want:
        raise _invalid(
            run, f"its checkpoint has key {min(have - want)!r}, which no declared variable has"
        )
    if want - have:
        raise _invalid(run, f"variable {min(want - have)!r} is not in its checkpoint")
    for v in manifest.variables:
        if dtypes[v.key].name != v.dtype or tuple(shapes[v.key]) != v.shape:
            raise _invalid(
                run,
                f"variable {v.key!r} is declared {v.dtype}{list(v.shape)}; the template has "
                f"{dtypes[v.key].name}{list(shapes[v.key])}",
            )

    saved_model_order = _order(
        run, "the template's object graph", saved_model_graph, manifest, "key"
    )
    checkpoint_order = _order(
        run, "checkpoint_object_graph", checkpoint_graph, manifest, "checkpoint_key"
    )
    copied = tuple((p, b) for p, b in files if p.split("/")[0] not in _NOT_COPIED)
    return _Template(
        manifest=manifest,
        # tf.saved_model.save always makes assets/, empty or not; uploads
        # carry files only, so an empty one is made here.
        dirs=tuple(sorted({d for d in dirs if d.split("/")[0] not in _NOT_COPIED} | {"assets"})),
        files=copied,
        saved_model_graph=saved_model_graph,
        checkpoint_graph=checkpoint_graph,
        saved_model_order=saved_model_order,
        checkpoint_order=checkpoint_order,
        # Only files copied verbatim: fingerprint.pb is rewritten for every save.
        checksums={p: (len(b), crc32c.crc32c(b)) for p, b in copied},
    )


def _read_tree(run: str, root: Path) -> tuple[list[str], list[tuple[str, bytes]]]:
    """Returns a tree's relative dirs and (path, content) files, sorted.

    Held in memory so a write never reads a template dir that a new
    registration may be replacing. Symlinks and special files are refused:
    they would let an upload copy arbitrary daemon files into exports.
    """
    dirs: list[str] = []
    files: list[tuple[str, bytes]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(root)
        for name in dirnames + sorted(filenames):
            path = Path(dirpath, name)
            rel = (rel_dir / name).as_posix()
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                raise _invalid(
                    run, f"{rel!r} is a symlink or special file; only plain files allowed"
                )
            if path.is_dir():
                dirs.append(rel)
            elif rel.split("/")[0] != "variables":  # read by tf.train.load_checkpoint
                files.append((rel, path.read_bytes()))
    return dirs, files


def _order(run: str, what: str, graph: bytes, manifest: Manifest, attr: str) -> tuple[int, ...]:
    """Manifest indexes in the order `graph` lists its variables' keys.

    Raises:
        InvalidRequestError: `graph` does not parse, holds non-variable state,
            or its keys are not exactly the manifest's `attr` values.
    """
    from google.protobuf import message
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    try:
        parsed = trackable_object_graph_pb2.TrackableObjectGraph.FromString(graph)
    except message.DecodeError as e:
        raise _invalid(run, f"{what} is not a TrackableObjectGraph ({e})") from None
    index = {getattr(v, attr): i for i, v in enumerate(manifest.variables)}
    order: list[int] = []
    seen: set[str] = set()
    for node in parsed.nodes:
        for attribute in node.attributes:
            if attribute.name != _VARIABLE_ATTRIBUTE:
                raise _invalid(
                    run,
                    f"{what} has {attribute.checkpoint_key!r} of kind {attribute.name!r}: "
                    "non-variable state is not supported",
                )
            key = attribute.checkpoint_key
            if key not in index:
                raise _invalid(run, f"{what} has key {key!r}, which no variable names as {attr}")
            if key not in seen:
                seen.add(key)
                order.append(index[key])
    if len(order) != len(index):
        absent = min(set(index) - seen)
        raise _invalid(run, f"variable {attr} {absent!r} is not in {what}")
    return tuple(order)


def _arrays(manifest: Manifest, snapshot: bytes | bytearray | memoryview) -> list[Any]:
    """Zero-copy NumPy views of each variable's bytes in the snapshot."""
    import numpy as np
    import tensorflow as tf

    arrays = []
    for v, (start, end) in zip(manifest.variables, manifest.offsets(), strict=True):
        # Native order equals the wire's little-endian on every platform TF ships for.
        dtype = np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype)
        if end == start:
            arrays.append(np.zeros(v.shape, dtype))
        else:
            flat = np.frombuffer(
                snapshot, dtype=dtype, count=(end - start) // dtype.itemsize, offset=start
            )
            arrays.append(flat.reshape(v.shape))
    return arrays


def _write_tree(
    template: _Template, kind: SaveKind, tmp: Path, snapshot: bytes | bytearray | memoryview
) -> int:
    """Writes a save's files into the empty dir `tmp`; returns their total size."""
    import tensorflow as tf

    arrays = _arrays(template.manifest, snapshot)
    variables = template.manifest.variables
    if kind is SaveKind.SAVED_MODEL:
        for rel in template.dirs:
            (tmp / rel).mkdir(exist_ok=True)
        for rel, content in template.files:
            (tmp / rel).write_bytes(content)
        order, names, graph = (
            template.saved_model_order,
            [v.key for v in variables],
            template.saved_model_graph,
        )
    elif kind is SaveKind.CHECKPOINT:
        order, names = template.checkpoint_order, [v.checkpoint_key for v in variables]
        graph = template.checkpoint_graph
    else:
        raise SaveFailedError(f"unknown save kind {kind!r}")
    (tmp / "variables").mkdir(exist_ok=True)
    tf.raw_ops.SaveV2(
        prefix=str(tmp / _VARIABLES_PREFIX),
        tensor_names=[names[i] for i in order] + [_OBJECT_GRAPH_KEY],
        shape_and_slices=[""] * (len(order) + 1),
        tensors=[arrays[i] for i in order] + [tf.constant(graph)],
    )
    if kind is SaveKind.SAVED_MODEL:
        from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting

        (tmp / "fingerprint.pb").write_bytes(fingerprinting.CreateFingerprintDef(str(tmp)))
    return sum(
        os.path.getsize(os.path.join(dirpath, name))
        for dirpath, _, filenames in os.walk(tmp)
        for name in filenames
    )
