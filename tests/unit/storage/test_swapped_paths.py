"""A path component swapped under a save or a retention pass is never followed (LocalStore on real dirs).

Property: whichever component of a save's path is replaced (by a new dir, a
symlink out of the root, a symlink elsewhere in the root, or a file), at
whichever point of the save or of a deletion, nothing outside the root is
written, renamed or deleted, a save either commits where it was checked or
is refused, and the store goes on saving.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointd.core.ports import SaveMeta, Staged
from checkpointd.protocol.errors import InvalidRequestError, SaveFailedError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.storage import save_manifest
from checkpointd.storage.local import LocalStore

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


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(min_value=1, max_value=3), data=st.data(), kind=st.sampled_from(_SWAPS))
def test_a_component_swapped_before_a_restore_read_is_never_followed(
    tmp_path_factory: pytest.TempPathFactory, depth: int, data: st.DataObject, kind: str
) -> None:
    root, outside, parts, index, store = _committed(tmp_path_factory, depth, data)
    try:
        (save,) = store.committed("run", None)
        _swap(root, parts, index, kind, outside)
        try:
            read = b"".join(store.read_ranges(save, [("saved_model.pb", 0, 5)]))
        except SaveFailedError:
            return  # refused: its dir is not where it was listed, or not a dir
        assert read == b"graph"  # the save's own bytes (moved along with its dir), never the decoy's
    finally:
        store.close()
