"""The TensorFlow writer: a run's template graph plus a snapshot's values.

Like `checkpointd.formats.policy_template`, which checks the uploaded templates, it imports
tensorflow only inside functions, so importing it (and `checkpointd --help`)
stays fast.

A SAVED_MODEL save copies the template's graph files and writes a new
`variables/` checkpoint holding the snapshot, under the SavedModel's own
checkpoint keys and object graph, then a fingerprint computed from the result.
A CHECKPOINT save writes the `variables/` checkpoint alone, under the keys and
object graph of `PolicySaver.save_checkpoint`. Tensors are written in the order
of the object graph's nodes, which is the order TensorFlow's own saver uses, so
the variable files are byte-identical to PolicySaver's for the same values.
Last, `checkpointd.manifest.json` (see `checkpointd.storage.save_manifest`) lists every file
with its size and CRC32C, so a crash or a bad disk can be told from a
complete save without TensorFlow.

Lock discipline: `_lock` guards `_templates` only. A write takes the run's
`Template` (immutable, its files held in memory) under the lock and then works
without it, so registering a new template never disturbs a write in progress.
`_register_lock` serializes the on-disk swap of template directories.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib.metadata
import logging
import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from checkpointd import __version__
from checkpointd.formats import numpy_files
from checkpointd.storage import local
from checkpointd.formats import policy_template
from checkpointd.storage import save_manifest
from checkpointd.protocol.errors import CheckpointdError, RunNotFoundError, SaveFailedError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.wire import ALIGNMENT  # Eigen's: TF wraps memory aligned to it without a copy
from checkpointd.core.manifest import Manifest, VariableSpec
from checkpointd.core.numpy_state import PREFIX as NUMPY_STATE_PREFIX
from checkpointd.core.numpy_state import NumpyPayload
from checkpointd.protocol.names import check_run_name
from checkpointd.formats.policy_template import OBJECT_GRAPH_KEY, VARIABLES_PREFIX, Template, describe

_LOGGER = logging.getLogger(__name__)

# A snapshot: every variable's bytes concatenated, or one buffer per variable.
Snapshot = bytes | bytearray | memoryview | Sequence[memoryview]


class TfWriter:
    """Writes SavedModels and checkpoints from run templates and snapshots.

    Implements `checkpointd.core.ports.Writer`. Thread-safe.
    """

    def __init__(self, state_dir: Path, *, fsync: bool = True, nice: int = 0) -> None:
        """Creates a writer.

        Args:
            state_dir: The daemon's own folder; templates live in
                `state_dir/templates/<run>/`.
            fsync: Whether to fsync written trees before publishing them.
            nice: The nice value of the threads that write saves (Linux sets
                it per thread): above 0, training on the same machine gets
                the CPU first and saves use what is left. 0 leaves them be.
        """
        self._templates_dir = Path(state_dir) / "templates"
        self._fsync = fsync
        self._lock = threading.Lock()
        self._register_lock = threading.Lock()
        self._templates: dict[str, Template] = {}
        # Saves are written on these threads, at `nice`; the gRPC threads that
        # answer decisions keep their priority, so a trainer's stall does not grow.
        self._workers = concurrent.futures.ThreadPoolExecutor(
            max_workers=16, thread_name_prefix="write", initializer=_lower_priority, initargs=(nice,)
        )
        # fsyncs a save's files while its manifest is computed (see write()).
        self._syncer = concurrent.futures.ThreadPoolExecutor(
            thread_name_prefix="fsync", initializer=_lower_priority, initargs=(nice,)
        )

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
            template = policy_template.validate(
                run, staged_dir, Manifest(tuple(variables)), checkpoint_object_graph
            )
            with self._register_lock:
                target = self._templates_dir / run
                tmp = local.make_temp_sibling(target)
                tmp.rmdir()
                shutil.move(staged_dir, tmp)
                try:
                    local.publish_dir(tmp, target, fsync=self._fsync)
                except BaseException:
                    local.remove_quietly(tmp)
                    raise
                with self._lock:
                    self._templates[run] = template
        except BaseException:
            local.remove_quietly(staged_dir)
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
        snapshot: Snapshot,
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
                concatenated in manifest order, or one buffer per variable
                (64-byte aligned and writable ones are written without a copy).
            step: The trainer's step, recorded in the save manifest.
            export_dir: The export dir as the trainer named it, for the
                save manifest; default `target.name`.
            numpy_state: A NumpyState to write beside the variables, as
                `<target>/numpy_state/numpy_state` (see checkpointd.formats.numpy_files).

        Returns:
            The total size of the files written, in bytes.

        Raises:
            RunNotFoundError: the run has no template.
            SaveFailedError: the save could not be written; nothing new is
                left on disk.
        """
        return self._workers.submit(
            self._write, run, kind, target, snapshot, step, export_dir, numpy_state
        ).result()

    def _write(
        self,
        run: str,
        kind: SaveKind,
        target: Path,
        snapshot: Snapshot,
        step: int,
        export_dir: str | None,
        numpy_state: NumpyPayload | None,
    ) -> int:
        """write(), on a writer thread."""
        with self._lock:
            template = self._templates.get(run)
        if template is None:
            raise RunNotFoundError(f"run {run!r} has no template on this daemon; register it first")
        target = Path(target)
        if isinstance(snapshot, (bytes, bytearray, memoryview)):
            size = memoryview(snapshot).nbytes
        else:
            sizes = [memoryview(p).nbytes for p in snapshot]
            if sizes != [v.nbytes for v in template.manifest.variables]:
                raise SaveFailedError(f"run {run!r}: snapshot parts do not match the manifest")
            size = sum(sizes)
        if size != template.manifest.nbytes:
            raise SaveFailedError(
                f"run {run!r}: snapshot has {size} bytes; the manifest needs "
                f"{template.manifest.nbytes}"
            )
        tmp: Path | None = None
        try:
            tmp = local.make_temp_sibling(target)
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
            # The disk flushes the files while the manifest's CRCs read them
            # back from the page cache (both release the GIL); publishing
            # then fsyncs only what is still dirty: the manifest and the dirs.
            syncing = self._syncer.submit(local.fsync_tree, tmp) if self._fsync else None
            try:
                written += save_manifest.write_manifest(
                    tmp,
                    run=run,
                    kind=kind.value,
                    step=step,
                    export_dir=target.name if export_dir is None else export_dir,
                    versions=_versions(),
                    known=template.checksums if kind is SaveKind.SAVED_MODEL else None,
                    extra=extra,
                )
            finally:
                if syncing is not None:
                    syncing.result()  # raises its OSError; the tree is not published
            local.publish_dir(tmp, target, fsync=self._fsync)
        except Exception as e:
            if tmp is not None:
                local.remove_quietly(tmp)
            if isinstance(e, CheckpointdError):
                raise
            reason = f"could not write {kind.value} to {target}: {describe(e)}"
            _LOGGER.warning("run %s: %s", run, reason)
            raise SaveFailedError(f"run {run!r}: {reason}") from e
        _LOGGER.debug("run %s: wrote %s to %s (%d bytes)", run, kind.value, target, written)
        return written


def _lower_priority(nice: int) -> None:
    """Raises this thread's nice value to `nice` (Linux: per thread); never lowers it."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:
        _LOGGER.warning("could not set the writer threads' nice value to %d: %s", nice, e)


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


def _arrays(manifest: Manifest, snapshot: Snapshot) -> list[Any]:
    """Each variable's value, as a tensor over the snapshot's bytes where TF allows it.

    `snapshot` is the concatenation of the variables' bytes, or one buffer per
    variable (as `checkpointd.rpc.upload.receive_snapshot` lays them out).
    """
    import numpy as np
    import tensorflow as tf

    if isinstance(snapshot, (bytes, bytearray, memoryview)):
        whole = memoryview(snapshot)
        parts: Sequence[Any] = [whole[s:e] for s, e in manifest.offsets()]
    else:
        parts = snapshot
    arrays = []
    for v, part in zip(manifest.variables, parts, strict=True):
        # Native order equals the wire's little-endian on every platform TF ships for.
        dtype = np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype)
        if memoryview(part).nbytes == 0:
            arrays.append(np.zeros(v.shape, dtype))
        else:
            arrays.append(_tensor(np.frombuffer(part, dtype=dtype).reshape(v.shape)))
    return arrays


# DLPack carries these; others (bfloat16, bool) go through convert_to_tensor.
_DLPACK_DTYPES = frozenset(
    "float16 float32 float64 int8 int16 int32 int64 uint8 uint16 uint32 uint64".split()
)


def _tensor(array: Any) -> Any:
    """`array` as SaveV2 input: a tensor sharing its memory if TF can, else `array`.

    TF copies every NumPy array it converts (0.5 s for 400 MB); DLPack wraps
    one without a copy, but TF aborts the process on memory that is not
    64-byte aligned, so only aligned, writable arrays take that way.
    """
    import tensorflow as tf

    if (
        array.dtype.name in _DLPACK_DTYPES
        and array.flags.writeable
        and array.flags.c_contiguous
        and array.ctypes.data % ALIGNMENT == 0
    ):
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return array


def _write_tree(template: Template, kind: SaveKind, tmp: Path, snapshot: Snapshot) -> int:
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
        prefix=str(tmp / VARIABLES_PREFIX),
        tensor_names=[names[i] for i in order] + [OBJECT_GRAPH_KEY],
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
