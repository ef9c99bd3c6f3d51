"""A path component swapped under a save, a retention pass or a restore is never followed (LocalStore on real dirs).

Property: whichever component of a save's path is replaced (by a new dir, a
symlink out of the root, a symlink elsewhere in the root, or a file), at
whichever point of the save or of a deletion, nothing outside the root is
written, renamed or deleted, a save either commits where it was checked or
is refused, and the store goes on saving. A restore (Restore through the
save's format, RestoreFiles sent or staged) of a committed save whose path
changed the same way, before its lookup or between any two of its steps,
gives the save's own bytes or a status from the errors table (a link in the
way: INVALID_ARGUMENT, or NOT_FOUND where the lookup no longer lists the
save); never a byte of the decoys outside the root or elsewhere in it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointd import bundle
from checkpointd.core.checkpoint_spec import CheckpointSpec, TensorSpec
from checkpointd.core.numpy_state import NumpyEntry, NumpyPayload, NumpyStateSpec
from checkpointd.core.ports import CommittedSave, SaveFormat, SaveMeta, Staged
from checkpointd.core.variable_manifest import Manifest, VariableSpec
from checkpointd.durable import files
from checkpointd.formats import numpy_files
from checkpointd.formats.policy import PolicyFormat
from checkpointd.formats.training_checkpoint import TrainingFormat
from checkpointd.protocol.errors import ChecksumError, InvalidRequestError, RunNotFoundError, SaveFailedError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import OLD_PREFIX, TMP_PREFIX
from checkpointd.protocol.tensors import OBJECT_GRAPH_KEY
from checkpointd.restores import committed as restore
from checkpointd.restores import files as restore_files
from checkpointd.restores import staged_files as restore_stage
from checkpointd.storage import save_manifest
from checkpointd.storage.local import LocalStore
from checkpointd.v1 import tf_formats_pb2

_SWAPS = ("dir", "symlink-out", "symlink-in", "file")
_STAGES = ("after-stage", "after-write", "before-commit")


def _snapshot(top: Path) -> dict[str, bytes | str]:
    """Every entry below `top`: a file's bytes, a link's target, a dir's marker."""
    seen: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(top).as_posix()
            if path.is_symlink():
                seen[rel] = "-> " + os.readlink(path)
            elif path.is_dir():
                seen[rel] = "dir"
            else:
                seen[rel] = path.read_bytes()
    return seen


def _swap(root: Path, parts: list[str], index: int, kind: str, outside: Path) -> None:
    """Replaces `root/parts[0]/.../parts[index]` by `kind`, moving what was there aside."""
    path = root.joinpath(*parts[: index + 1])
    if path.is_symlink() or path.exists():
        path.rename(path.with_name(path.name + "-moved"))
    if kind == "dir":
        path.mkdir()
    elif kind == "symlink-out":
        path.symlink_to(outside.joinpath(*parts[1 : index + 1]), target_is_directory=True)
    elif kind == "symlink-in":
        elsewhere = root / "elsewhere"  # another run's folder
        elsewhere.mkdir(exist_ok=True)
        path.symlink_to(elsewhere, target_is_directory=True)
    else:
        path.write_bytes(b"a file in the way")


def _mirror(outside: Path, parts: list[str]) -> None:
    """Decoys outside the root, shaped like the save's path, for a followed link to hit."""
    decoy = outside.joinpath(*parts[1:])
    decoy.mkdir(parents=True, exist_ok=True)
    (decoy / "saved_model.pb").write_bytes(b"not the daemon's")
    (decoy.parent / f"{decoy.name}.index").write_bytes(b"decoy prefix")


def _save(store: LocalStore, folder: str, export_dir: str, step: int, swap: object = None, when: str = "") -> Path:
    """One save as the pipeline makes it: target, stage, write, target again, commit; discarded on failure."""
    target = store.target(folder, export_dir)
    staging = store.stage(target)
    try:
        if when == "after-stage" and callable(swap):
            swap()
        (staging / "variables").mkdir()
        (staging / "variables" / "variables.index").write_bytes(b"index %d" % step)
        (staging / "saved_model.pb").write_bytes(b"graph")
        if when == "after-write" and callable(swap):
            swap()
        target = store.target(folder, export_dir)  # the pipeline's check at commit
        if when == "before-commit" and callable(swap):
            swap()
        meta = SaveMeta(folder, SaveKind.SAVED_MODEL, step, export_dir)
        store.commit(Staged(path=staging, bytes_written=10, versions={}), target, meta)
        return Path(target)
    except BaseException:
        store.discard(staging)
        raise


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    depth=st.integers(min_value=1, max_value=3),
    data=st.data(),
    kind=st.sampled_from(_SWAPS),
    when=st.sampled_from(_STAGES),
)
def test_a_component_swapped_during_a_save_is_never_followed(
    tmp_path_factory: pytest.TempPathFactory, depth: int, data: st.DataObject, kind: str, when: str
) -> None:
    base = tmp_path_factory.mktemp("swap")
    root, outside = base / "root", base / "outside"
    parts = ["run", *[f"d{i}" for i in range(depth - 1)], "policy"]
    index = data.draw(st.integers(min_value=0, max_value=len(parts) - 2), label="component")  # a dir of the path
    _mirror(outside, parts)
    before = _snapshot(outside)
    store = LocalStore(root, fsync=False)
    try:
        try:
            target = _save(store, "run", "/".join(parts[1:]), 1, lambda: _swap(root, parts, index, kind, outside), when)
        except (InvalidRequestError, SaveFailedError):
            pass  # refused: the path changed under it
        else:
            # Committed: where it was checked, inside the root, whole.
            assert Path(os.path.realpath(target)).is_relative_to(os.path.realpath(root))
            assert save_manifest.read_manifest(target)["step"] == 1
        assert _snapshot(outside) == before
        assert not [p for p in root.rglob(".checkpointd-tmp-*")], "a refused save left its staging"
        # The store serves on: a save elsewhere commits.
        assert save_manifest.read_manifest(_save(store, "other", "policy", 2))["step"] == 2
    finally:
        store.close()


def _committed(
    tmp_path_factory: pytest.TempPathFactory, depth: int, data: st.DataObject
) -> tuple[Path, Path, list[str], int, LocalStore]:
    """A store with one committed save `depth` dirs deep, decoys outside, and the component to swap (the save's own too)."""
    base = tmp_path_factory.mktemp("swap")
    root, outside = base / "root", base / "outside"
    parts = ["run", *[f"d{i}" for i in range(depth - 1)], "policy"]
    index = data.draw(st.integers(min_value=0, max_value=len(parts) - 1), label="component")
    _mirror(outside, parts)
    store = LocalStore(root, fsync=False)
    _save(store, "run", "/".join(parts[1:]), 1)
    return root, outside, parts, index, store


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(min_value=1, max_value=3), data=st.data(), kind=st.sampled_from(_SWAPS))
def test_a_component_swapped_before_a_retention_pass_is_never_followed(
    tmp_path_factory: pytest.TempPathFactory, depth: int, data: st.DataObject, kind: str
) -> None:
    root, outside, parts, index, store = _committed(tmp_path_factory, depth, data)
    try:
        (save,) = store.committed("run", None)
        state_file = Path(save.path).parent / "checkpoint"
        before = _snapshot(outside)
        _swap(root, parts, index, kind, outside)
        store.delete(save)
        assert _snapshot(outside) == before
        if index == 0 and kind.startswith("symlink"):
            return  # a run's folder may be a link (to another disk): the state file, written anew, follows it
        try:
            store.write_file(state_file, b"model_checkpoint_path: 'x'\n")
        except (InvalidRequestError, OSError):
            pass  # its dir is not there any more, or not the one it was
        assert _snapshot(outside) == before
    finally:
        store.close()


# --- Restores: Restore through the formats' readers, RestoreFiles sent and staged ---

_NUMPY_KEY = "numpy_arrays/a0/.ATTRIBUTES/py_state"
_VARIABLE = VariableSpec("w/.ATTRIBUTES/VARIABLE_VALUE", "w/.ATTRIBUTES/VARIABLE_VALUE", "float32", (4,))
_POLICY_MANIFEST = Manifest((_VARIABLE,))
# Restore's errors (the table's INVALID_ARGUMENT, NOT_FOUND, INTERNAL, DATA_LOSS); a link in the way is one of the first two.
_REFUSED = (InvalidRequestError, RunNotFoundError, SaveFailedError, ChecksumError)
_LINK_REFUSED = (InvalidRequestError, RunNotFoundError)


def _graph(attributes: list[tuple[str, str]]) -> bytes:
    """A TrackableObjectGraph: a root whose children each hold one attribute (name, checkpoint key)."""
    graph = tf_formats_pb2.TrackableObjectGraph()
    root = graph.nodes.add()
    for i, (name, key) in enumerate(attributes):
        root.children.add(node_id=i + 1, local_name=f"c{i}")
        graph.nodes.add().attributes.add(name=name, full_name=key, checkpoint_key=key)
    return graph.SerializeToString()


_TRAINING = CheckpointSpec(
    _graph([("VARIABLE_VALUE", "w/.ATTRIBUTES/VARIABLE_VALUE"), ("py_state", "s/.ATTRIBUTES/py_state")]),
    (
        TensorSpec("w/.ATTRIBUTES/VARIABLE_VALUE", "float32", (4,), 16),
        TensorSpec("s/.ATTRIBUTES/py_state", "string", (), 6),
    ),
)


def _values(mark: int) -> tuple[bytes, bytes]:
    """A save's two values (16 bytes of variable, 6 of state), all bytes `mark`: whose save a read came from."""
    return bytes([mark]) * 16, bytes([mark]) * 6


def _commit_restorable(store: LocalStore, folder: str, export_dir: str, training: bool, mark: int) -> None:
    """Commits a save the real formats read back: a training checkpoint, or a policy save with numpy state."""
    variable, state = _values(mark)
    target = store.target(folder, export_dir)
    staging = store.stage(target)
    try:
        if training:
            staged = TrainingFormat().write(
                folder, SaveKind.TRAINING_CHECKPOINT, _POLICY_MANIFEST, staging, [variable, state], None,
                checkpoint=_TRAINING,
            )  # fmt: skip
            kind = SaveKind.TRAINING_CHECKPOINT
        else:
            (staging / "variables").mkdir()
            entries = [bundle.Entry(_VARIABLE.key, "float32", (4,), 16), bundle.string_entry(OBJECT_GRAPH_KEY, b"g")]
            bundle.write(staging / "variables" / "variables", entries, [variable, [b"g"]])
            spec = NumpyStateSpec(_graph([("py_state", _NUMPY_KEY)]), (NumpyEntry(_NUMPY_KEY, len(state)),))
            numpy_files.write(staging, NumpyPayload(spec, state))
            staged, kind = Staged(path=staging, bytes_written=1, versions={}), SaveKind.SAVED_MODEL
        store.commit(staged, target, SaveMeta(folder, kind, mark, export_dir))
    except BaseException:
        store.discard(staging)
        raise


def _restorable(
    tmp_path_factory: pytest.TempPathFactory, depth: int, training: bool, data: st.DataObject
) -> tuple[Path, Path, list[str], str, LocalStore]:
    """A store with one restorable save `depth` dirs deep (its values all 1s), decoys of it (all 2s) outside
    the root (`outside` mirrors the run's folder) and in another run's folder; the components of its path
    (its dirs, then the dir or file a restore reads below them) and its export dir."""
    base = tmp_path_factory.mktemp("swap")
    root, outside = base / "root", base / "outside"
    export_dir = "/".join([*(f"d{i}" for i in range(depth - 1)), "train/ckpt-1" if training else "policy"])
    store = LocalStore(root, fsync=False)
    _commit_restorable(store, "run", export_dir, training, 1)
    _commit_restorable(store, "elsewhere", export_dir, training, 2)  # where "symlink-in" leads
    decoys = LocalStore(base / "decoys", fsync=False)
    try:
        _commit_restorable(decoys, "run", export_dir, training, 2)
    finally:
        decoys.close()
    (base / "decoys" / "run").rename(outside)
    below = "ckpt-1.index" if training else data.draw(st.sampled_from(["variables", "numpy_state"]), label="below")
    parts = ["run", *export_dir.split("/")]
    parts = [*parts[:-1], below] if training else [*parts, below]
    return root, outside, parts, export_dir, store


def _format_for(kind: SaveKind) -> SaveFormat:
    return TrainingFormat() if kind is SaveKind.TRAINING_CHECKPOINT else PolicyFormat(Path("/nonexistent"))


_RESTORES = ("restore", "restore-files", "restore-files-staged")
_RESTORE_STAGES = ("before-lookup", "after-lookup", "after-open")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    depth=st.integers(min_value=1, max_value=3),
    training=st.booleans(),
    data=st.data(),
    kind=st.sampled_from(_SWAPS),
    call=st.sampled_from(_RESTORES),
    when=st.sampled_from(_RESTORE_STAGES),
    named=st.booleans(),
)
def test_a_component_swapped_before_or_during_a_restore_is_never_followed(
    tmp_path_factory: pytest.TempPathFactory,
    depth: int,
    training: bool,
    data: st.DataObject,
    kind: str,
    call: str,
    when: str,
    named: bool,
) -> None:
    root, outside, parts, export_dir, store = _restorable(tmp_path_factory, depth, training, data)
    index = data.draw(st.integers(min_value=0, max_value=len(parts) - 1), label="component")
    before = _snapshot(outside)
    asked = export_dir if named else ""  # the save by its name, or the run's newest
    # The run's folder itself may be a link (to another disk): one there at the lookup is followed, by design.
    run_folder_linked = index == 0 and when == "before-lookup" and kind.startswith("symlink")

    def swap() -> None:
        _swap(root, parts, index, kind, outside)

    if when == "before-lookup":
        swap()
    elif when == "after-lookup":  # found (and its files listed), not opened yet
        lend = store.held

        def swapped_then_held(save: CommittedSave) -> AbstractContextManager[CommittedSave]:
            swap()
            return lend(save)

        store.held = swapped_then_held  # type: ignore[method-assign]
    try:
        if call == "restore":
            with restore.opening(store, _format_for, "run", "run", asked, _POLICY_MANIFEST) as opened:
                if when == "after-open":
                    swap()  # the files are open or about to be, the values not read yet
                got = b"".join(bytes(p) for p in opened.values.pieces())
        else:
            plan = restore_files.plan(store, "run", "run", asked, [], False)
            if when != "before-lookup":
                swap()  # the files listed and checked, not read yet
            if call == "restore-files":
                got = b"".join(p.data for p in restore_files.pieces(store, plan))
            else:
                with restore_stage.staged(store, plan, tmp_path_factory.mktemp("staging")) as staged:
                    got = b"".join((staged.dir / f.path).read_bytes() for f in plan.files)
    except _REFUSED as e:
        if kind.startswith("symlink") and not run_folder_linked:
            assert isinstance(e, _LINK_REFUSED), f"a link in the way gave {type(e).__name__}: {e}"
    else:
        if not run_folder_linked:
            own_variable, own_state = _values(1)
            assert b"\x02" * 6 not in got, "read a decoy's bytes"
            assert own_variable in got and own_state in got, "not the save's own bytes"
    finally:
        store.close()
    assert _snapshot(outside) == before


# --- Recovery at the daemon's start ---


def _leftovers(top: Path, parts: list[str]) -> None:
    """What crashed saves leave, in every dir of `parts` below `top`: temp dirs and files, and a replaced tree."""
    top.mkdir(parents=True, exist_ok=True)
    where = top
    for part in parts:
        where = where / part
        where.mkdir(exist_ok=True)
        hex_ = "0123456789abcdef"
        (where / f"{TMP_PREFIX}policy-{hex_}").mkdir()
        (where / f"{TMP_PREFIX}policy-{hex_}" / "saved_model.pb").write_bytes(b"half a save")
        (where / f"{TMP_PREFIX}checkpoint-{hex_}").write_bytes(b"half a state file")
        (where / "policy").mkdir()
        (where / f"{OLD_PREFIX}policy-{hex_}").mkdir()  # replaced by `policy`: deleted by recover


class _Listed:
    """A dir's entries, listed whole at once (before a swap), for a loop or a `with`."""

    def __init__(self, entries: Iterator[os.DirEntry[str]]) -> None:
        with entries:  # type: ignore[attr-defined]
            self._entries = list(entries)

    def __iter__(self) -> Iterator[os.DirEntry[str]]:
        return iter(self._entries)

    def __enter__(self) -> _Listed:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    depth=st.integers(min_value=1, max_value=3),
    data=st.data(),
    kind=st.sampled_from(_SWAPS),
    when=st.sampled_from(("before", "during")),
)
def test_a_component_swapped_before_or_during_recovery_is_never_followed(
    tmp_path_factory: pytest.TempPathFactory, depth: int, data: st.DataObject, kind: str, when: str
) -> None:
    base = tmp_path_factory.mktemp("swap")
    root, outside = base / "root", base / "outside"
    parts = ["run", *[f"d{i}" for i in range(depth)]]
    index = data.draw(st.integers(min_value=0, max_value=len(parts) - 1), label="component")
    _leftovers(root, parts)
    _leftovers(outside, parts[1:])  # decoys a followed link would lead recover to
    (root / "elsewhere").mkdir()
    before = _snapshot(outside)
    scandir = os.scandir
    listed: list[object] = []

    def swapping_scandir(*args: object) -> _Listed:
        """os.scandir, with the swap made once recover has listed the root."""
        entries = _Listed(scandir(*args))  # type: ignore[call-overload]
        if not listed:
            listed.append(args)
            _swap(root, parts, index, kind, outside)
        return entries

    if when == "before":
        _swap(root, parts, index, kind, outside)
    with pytest.MonkeyPatch.context() as patch:
        if when == "during":
            patch.setattr(os, "scandir", swapping_scandir)
        files.recover(root)
    assert _snapshot(outside) == before
    # Recovery did its work where nothing was swapped: the root's own leftovers are gone.
    assert not [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)]
