"""Run templates: an uploaded PolicySaver.save() output, checked and held in memory.

`validate` checks an upload by parsing its files, not by loading the model:
the SavedModel has one meta graph with the TF-Agents policy signatures,
`policy_specs.pbtxt` parses, the `variables/` checkpoint holds exactly the
declared variables (keys, dtypes, shapes), and both object graphs (the
SavedModel's and PolicySaver.save_checkpoint's) list exactly those
variables. What passes becomes a `Template`: the graph files to copy into
every SAVED_MODEL save, the two object graphs and the order in which each
lists the variables, which is the order `checkpointd.formats.policy` writes them in.

Every save writes its own values, so the template's are never read. A
template's `variables/` comes in one of two forms: the index alone with
`variables/object_graph.pb` (the SavedModel checkpoint's object graph,
raw), which the reference client sends; or PolicySaver's whole checkpoint,
index and data shards, whose object graph is read from the data (older
clients). The index gives keys, dtypes and shapes either way: TensorFlow's
reader reads a shard only to return a tensor's value. Both forms at once
are refused, as there would be two object graphs to choose from.

A variable's two keys are not taken on trust: the checkpoint key each
declared variable comes with must be the one the object graphs give the same
object (`object_graph.checkpoint_keys`). Else two variables of one shape and
dtype could be declared with their checkpoint keys swapped, and every
CHECKPOINT save would hold each one's values under the other's name.

The template's fingerprint is the trainer's: `tf.saved_model.save` writes
`fingerprint.pb` at the export (TensorFlow's `CreateFingerprintDef`), and the
upload carries it. The daemon checks that it parses and keeps it; each save
replaces only its checkpoint_hash (`checkpointd.formats.policy`). No
TensorFlow here: the protos are `checkpointd.v1.tf_formats_pb2` (wire-identical
with TensorFlow's), the checkpoint's index is read by
`checkpointd.bundle.reader`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import crc32c
from google.protobuf import message, text_format

from checkpointd.bundle.reader import BundleReader, UnreadableBundleError
from checkpointd.core.numpy_state import DIRECTORY as NUMPY_STATE_DIRECTORY
from checkpointd.core.variable_manifest import Manifest
from checkpointd.formats import object_graph
from checkpointd.formats.object_graph import ObjectGraph
from checkpointd.protocol.errors import InvalidRequestError, describe
from checkpointd.protocol.names import MANIFEST_NAME
from checkpointd.protocol.tensors import OBJECT_GRAPH_KEY, TEMPLATE_OBJECT_GRAPH, VARIABLE_ATTRIBUTE
from checkpointd.v1 import tf_formats_pb2

_LOGGER = logging.getLogger(__name__)

VARIABLES_PREFIX = os.path.join("variables", "variables")
_INDEX = "variables/variables.index"
_DATA_SHARD = "variables/variables.data-"  # a data shard's path starts so
_REQUIRED_SIGNATURES = ("action", "get_initial_state", "get_train_step", "get_metadata")
# Written anew for every SAVED_MODEL save, never copied from the template.
_FINGERPRINT = "fingerprint.pb"
_NOT_COPIED = ("variables", _FINGERPRINT)
# Top-level names every save gets from the daemon: the manifest, and NumPy state beside the variables.
_WRITTEN_BY_THE_DAEMON = (MANIFEST_NAME, NUMPY_STATE_DIRECTORY)


@dataclass(frozen=True)
class Template:
    """What a write needs of a run's template; never changed once made."""

    manifest: Manifest
    dirs: tuple[str, ...]  # relative dirs to create, parents first (e.g. "assets")
    files: tuple[tuple[str, bytes], ...]  # relative path, content
    saved_model_graph: bytes  # the SavedModel checkpoint's object graph
    checkpoint_graph: bytes  # PolicySaver.save_checkpoint's object graph
    saved_model_order: tuple[int, ...]  # manifest indexes in SavedModel key order
    checkpoint_order: tuple[int, ...]  # manifest indexes in checkpoint key order
    checksums: dict[str, tuple[int, int]]  # files' (size, CRC32C), for save manifests
    # The template's FingerprintDef, serialized: every field but checkpoint_hash
    # hashes saved_model.pb alone, which every save copies unchanged.
    fingerprint: bytes


def _invalid(run: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"template of run {run!r}: {what}")


def validate(run: str, staged_dir: Path, manifest: Manifest, checkpoint_graph: bytes) -> Template:
    """Checks an uploaded template against the manifest; returns its Template.

    Args:
        run: The run name, for messages.
        staged_dir: The uploaded SavedModel; only read.
        manifest: The variables every snapshot of the run holds, in order.
        checkpoint_graph: The serialized TrackableObjectGraph that
            PolicySaver.save_checkpoint writes for the policy.

    Raises:
        InvalidRequestError: the upload is not a TF-Agents policy SavedModel,
            or the manifest or the object graph disagree with it.
    """
    if not staged_dir.is_dir():
        raise _invalid(run, "is not a directory")
    dirs, files, variable_files = _read_tree(run, staged_dir)
    contents = dict(files)
    for path, _ in files:
        top = path.split("/")[0]
        if top in _WRITTEN_BY_THE_DAEMON:
            raise _invalid(
                run, f"has {path!r}; {top!r} is written by the daemon into every save, so a template may not hold it"
            )

    if "saved_model.pb" not in contents:
        raise _invalid(run, "has no saved_model.pb; upload the output of PolicySaver.save()")
    try:
        saved_model = tf_formats_pb2.SavedModel.FromString(contents["saved_model.pb"])
    except message.DecodeError as e:
        raise _invalid(run, f"saved_model.pb is not a SavedModel ({e})") from None
    if len(saved_model.meta_graphs) != 1:
        raise _invalid(run, f"saved_model.pb has {len(saved_model.meta_graphs)} meta graphs, expected 1")
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
        text_format.Parse(contents["policy_specs.pbtxt"].decode("utf-8"), tf_formats_pb2.StructuredValue())
    except (text_format.ParseError, UnicodeDecodeError) as e:
        raise _invalid(run, f"policy_specs.pbtxt does not parse ({e})") from None

    shapes, dtypes, saved_model_graph, graph_source = _checkpoint(run, staged_dir, variable_files)
    want = {v.key for v in manifest.variables}
    have = set(shapes) - {OBJECT_GRAPH_KEY}
    if have - want:
        raise _invalid(run, f"its checkpoint has key {min(have - want)!r}, which no declared variable has")
    if want - have:
        raise _invalid(run, f"variable {min(want - have)!r} is not in its checkpoint")
    for v in manifest.variables:
        if dtypes[v.key] != v.dtype or shapes[v.key] != v.shape:
            raise _invalid(
                run,
                f"variable {v.key!r} is declared {v.dtype}{list(v.shape)}; the template has "
                f"{dtypes[v.key]}{list(shapes[v.key])}",
            )

    saved_model_parsed = _parse(run, graph_source, saved_model_graph)
    checkpoint_parsed = _parse(run, "checkpoint_object_graph", checkpoint_graph)
    saved_model_order = _order(run, graph_source, saved_model_parsed, manifest, "key")
    checkpoint_order = _order(run, "checkpoint_object_graph", checkpoint_parsed, manifest, "checkpoint_key")
    _check_checkpoint_keys(run, manifest, saved_model_parsed, checkpoint_parsed)
    copied = tuple((p, b) for p, b in files if p.split("/")[0] not in _NOT_COPIED)
    return Template(
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
        checksums={p: size_and_crc(b) for p, b in copied},
        fingerprint=_fingerprint(run, contents),
    )


def size_and_crc(content: bytes) -> tuple[int, int]:
    """(size, CRC32C) of a file's bytes, as save manifests list it (`known`)."""
    return len(content), crc32c.crc32c(content)


def _fingerprint(run: str, contents: dict[str, bytes]) -> bytes:
    """The template's fingerprint.pb, as the trainer's export wrote it (TensorFlow's FingerprintDef).

    Every field but checkpoint_hash hashes saved_model.pb alone, which every
    save copies unchanged, so a save only replaces checkpoint_hash, the hash
    of its own variables.index (`checkpointd.formats.policy`).

    Raises:
        InvalidRequestError: the upload has no fingerprint.pb, or it is not a FingerprintDef.
    """
    data = contents.get(_FINGERPRINT)
    if data is None:
        raise _invalid(
            run,
            f"has no {_FINGERPRINT}; send every file PolicySaver.save() wrote (TensorFlow 2.15 writes "
            f"{_FINGERPRINT}, the SavedModel's fingerprint, which every save's is made from)",
        )
    try:
        fingerprint = tf_formats_pb2.FingerprintDef.FromString(data)
    except message.DecodeError as e:
        raise _invalid(run, f"{_FINGERPRINT} is not a FingerprintDef ({e})") from None
    if not fingerprint.saved_model_checksum:
        raise _invalid(run, f"{_FINGERPRINT} has no saved_model_checksum: is it TensorFlow's fingerprint?")
    return data


def _checkpoint(
    run: str, staged_dir: Path, names: set[str]
) -> tuple[dict[str, tuple[int, ...]], dict[str, str], bytes, str]:
    """The template checkpoint's shapes and dtypes by key, its object graph, and where that came from.

    Args:
        names: the files under `variables/`, relative to `staged_dir`.

    Raises:
        InvalidRequestError: `variables/` is in neither form (see the module
            docstring) or its index cannot be read.
    """
    shards = sorted(n for n in names if n.startswith(_DATA_SHARD))
    graph_file = TEMPLATE_OBJECT_GRAPH in names
    if _INDEX not in names:
        raise _invalid(
            run,
            f"has no {_INDEX}; send the index of PolicySaver.save()'s checkpoint with {TEMPLATE_OBJECT_GRAPH} "
            "(its object graph), or its whole variables/ checkpoint",
        )
    if graph_file and shards:
        raise _invalid(
            run,
            f"has both {TEMPLATE_OBJECT_GRAPH} and the data shard {shards[0]!r}, two object graphs; send "
            f"{_INDEX} with {TEMPLATE_OBJECT_GRAPH} and no data shards, or the whole checkpoint without it",
        )
    if not graph_file and not shards:
        raise _invalid(
            run,
            f"has {_INDEX} but neither {TEMPLATE_OBJECT_GRAPH} nor the data shards; the daemon needs the "
            f"checkpoint's object graph: send it as {TEMPLATE_OBJECT_GRAPH} (the {OBJECT_GRAPH_KEY} tensor's "
            "bytes), or the whole checkpoint",
        )
    try:
        reader = BundleReader(staged_dir / VARIABLES_PREFIX)
        shapes = {key: t.shape for key, t in reader.tensors.items()}
        dtypes = {key: t.dtype for key, t in reader.tensors.items()}
        if graph_file:
            graph: bytes | None = (staged_dir / TEMPLATE_OBJECT_GRAPH).read_bytes()
        else:
            graph = reader.string(OBJECT_GRAPH_KEY) if OBJECT_GRAPH_KEY in shapes else None
    except UnreadableBundleError as e:
        _LOGGER.debug("run %s: template checkpoint unreadable: %s", run, describe(e))
        raise _invalid(
            run,
            f"its checkpoint ({_INDEX}{'' if graph_file else ' and its data shards'}) is unreadable; "
            "send the files PolicySaver.save() wrote, unchanged",
        ) from None
    if graph is None:
        raise _invalid(run, f"variables/ has no {OBJECT_GRAPH_KEY} tensor")
    return shapes, dtypes, graph, TEMPLATE_OBJECT_GRAPH if graph_file else "the template's object graph"


def _read_tree(run: str, root: Path) -> tuple[list[str], list[tuple[str, bytes]], set[str]]:
    """Returns a tree's relative dirs and (path, content) files, sorted, and the paths under variables/.

    Held in memory so a write never reads a template dir that a new
    registration may be replacing; files under variables/ are only named
    (TensorFlow's reader and `_checkpoint` read them). Symlinks and special
    files are refused: they would let an upload copy arbitrary daemon files
    into exports.
    """
    dirs: list[str] = []
    files: list[tuple[str, bytes]] = []
    variable_files: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(root)
        for name in dirnames + sorted(filenames):
            path = Path(dirpath, name)
            rel = (rel_dir / name).as_posix()
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                raise _invalid(run, f"{rel!r} is a symlink or special file; only plain files allowed")
            if path.is_dir():
                dirs.append(rel)
            elif rel.split("/")[0] == "variables":
                variable_files.add(rel)
            else:
                files.append((rel, path.read_bytes()))
    return dirs, files, variable_files


def _parse(run: str, what: str, graph: bytes) -> ObjectGraph:
    return object_graph.parse(graph, f"template of run {run!r}: {what}")


def _order(run: str, what: str, graph: ObjectGraph, manifest: Manifest, attr: str) -> tuple[int, ...]:
    """Manifest indexes in the order `graph` lists its variables' keys.

    Raises:
        InvalidRequestError: `graph` holds non-variable state, or its keys are
            not exactly the manifest's `attr` values.
    """
    keys = object_graph.attribute_keys(
        graph, VARIABLE_ATTRIBUTE, f"template of run {run!r}: {what}", "non-variable state is not supported"
    )
    index = {getattr(v, attr): i for i, v in enumerate(manifest.variables)}
    order: list[int] = []
    seen: set[str] = set()
    for key in keys:
        if key not in index:
            raise _invalid(run, f"{what} has key {key!r}, which no variable names as {attr}")
        if key not in seen:
            seen.add(key)
            order.append(index[key])
    if len(order) != len(index):
        absent = min(set(index) - seen)
        raise _invalid(run, f"variable {attr} {absent!r} is not in {what}")
    return tuple(order)


def _check_checkpoint_keys(run: str, manifest: Manifest, saved_model: ObjectGraph, checkpoint: ObjectGraph) -> None:
    """Refuses a declared checkpoint key that is not the one the graphs give its variable.

    Raises:
        InvalidRequestError: naming the first such variable (manifest order)
            and both keys.
    """
    derived = object_graph.checkpoint_keys(saved_model, checkpoint, VARIABLE_ATTRIBUTE)
    for v in manifest.variables:
        want = derived.get(v.key)
        if want is None:
            raise _invalid(
                run,
                f"variable {v.key!r} has no counterpart under {object_graph.POLICY_CHILD!r} in "
                "checkpoint_object_graph: the two graphs are not of one policy "
                "(tf.train.Checkpoint(policy=..., ...) as PolicySaver.save_checkpoint builds it)",
            )
        if want != v.checkpoint_key:
            raise _invalid(
                run,
                f"variable {v.key!r} is declared with checkpoint_key {v.checkpoint_key!r}, but "
                f"checkpoint_object_graph stores that variable as {want!r}",
            )
