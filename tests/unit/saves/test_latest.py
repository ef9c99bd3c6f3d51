"""Committed saves found on disk (GetLatest's search), and a save's numpy state spec.

No TensorFlow: saves are made of arbitrary bytes with real save manifests; the
search reads manifests only. The daemon tier (tests/integration/restore/test_restore.py)
runs the same search behind the RPC, after a real daemon restart.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpointd.core.numpy_state import NumpyEntry, NumpyPayload, NumpyStateSpec, check_payload
from checkpointd.core.variable_manifest import Manifest, VariableSpec
from checkpointd.protocol.errors import AlreadyExistsError, InvalidRequestError, LimitExceededError, RunNotFoundError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.saves.catalog import find_latest
from checkpointd.saves.runs import Lanes
from checkpointd.storage import save_manifest
from checkpointd.storage.local import LocalStore

FILES = {"variables/variables.index": b"index", "variables/variables.data-00000-of-00001": b"d" * 64}


def save(
    root: Path, folder: str, export_dir: str, *, run: str, kind: str = "checkpoint",
    step: int = 1, created: float = 1_000.0, manifest: bool = True,
) -> Path:  # fmt: skip
    path = root / folder / export_dir
    for rel, data in FILES.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    if manifest:
        save_manifest.write_manifest(
            path, run=run, kind=kind, step=step, export_dir=export_dir,
            versions={"checkpointd": "test"}, created=created,
        )  # fmt: skip
    return path


def test_the_newest_save_is_the_latest_created_then_the_highest_step(tmp_path: Path) -> None:
    save(tmp_path, "r", "ckpt/a", run="r", step=5, created=100.0)
    save(tmp_path, "r", "ckpt/b", run="r", step=3, created=200.0)
    newest = save(tmp_path, "r", "ckpt/c", run="r", step=4, created=200.0)

    found = find_latest(LocalStore(tmp_path), "r", "r")

    assert found is not None
    assert (found.path, found.export_dir, found.step, found.created) == (
        newest.resolve(), "ckpt/c", 4, 200.0,
    )  # fmt: skip
    assert found.kind is SaveKind.CHECKPOINT


def test_kind_filters_and_other_runs_in_the_folder_do_not_count(tmp_path: Path) -> None:
    save(tmp_path, "r", "policy", run="r", kind="saved_model", step=0, created=10.0)
    save(tmp_path, "r", "ckpt/1", run="r", step=1, created=20.0)
    save(tmp_path, "r", "greedy", run="r.greedy", kind="saved_model", step=9, created=30.0)

    assert find_latest(LocalStore(tmp_path), "r", "r").export_dir == "ckpt/1"
    assert find_latest(LocalStore(tmp_path), "r", "r", SaveKind.SAVED_MODEL).export_dir == "policy"
    assert find_latest(LocalStore(tmp_path), "r", "r.greedy").export_dir == "greedy"
    assert find_latest(LocalStore(tmp_path), "r", "r.greedy", SaveKind.CHECKPOINT) is None


def test_uncommitted_dirs_are_not_saves(tmp_path: Path) -> None:
    save(tmp_path, "r", "ckpt/1", run="r", step=1, created=10.0)
    save(tmp_path, "r", "ckpt/torn", run="r", step=99, created=99.0, manifest=False)
    save(tmp_path, "r", ".checkpointd-tmp-ckpt-00", run="r", step=98, created=98.0)
    (tmp_path / "r" / "ckpt" / "junk").mkdir()
    (tmp_path / "r" / "ckpt" / "junk" / save_manifest.MANIFEST_NAME).write_text("{not json")

    assert find_latest(LocalStore(tmp_path), "r", "r").export_dir == "ckpt/1"


def test_no_folder_or_no_save_is_none(tmp_path: Path) -> None:
    assert find_latest(LocalStore(tmp_path), "absent", "absent") is None
    (tmp_path / "empty").mkdir()
    assert find_latest(LocalStore(tmp_path), "empty", "empty") is None


def test_committed_save_reads_one_export_dir_or_says_not_found(tmp_path: Path) -> None:
    save(tmp_path, "r", "ckpt/1", run="r", step=7)
    save(tmp_path, "r", "ckpt/torn", run="r", manifest=False)

    assert LocalStore(tmp_path).committed_at("r", "./ckpt/1").step == 7
    with pytest.raises(RunNotFoundError):
        LocalStore(tmp_path).committed_at("r", "ckpt/torn")
    with pytest.raises(RunNotFoundError):
        LocalStore(tmp_path).committed_at("r", "ckpt/2")
    with pytest.raises(InvalidRequestError):
        LocalStore(tmp_path).committed_at("r", "../other/ckpt")


def test_lanes_remember_each_runs_folder(tmp_path: Path) -> None:
    lanes = Lanes()
    manifest = Manifest((VariableSpec("k", "c", "float32", (2,)),))
    lanes.register("r", manifest)
    lanes.register("r.greedy", manifest, "r")

    assert (lanes.folder("r"), lanes.folder("r.greedy")) == ("r", "r")
    with pytest.raises(AlreadyExistsError):  # open: another stream of its name may not move it
        lanes.register("r.greedy", manifest)
    assert lanes.folder("r.greedy") == "r"
    lanes.close("r.greedy", timeout=5.0)
    lanes.register("r.greedy", manifest)  # closed, registered again without a folder: its own name
    assert lanes.folder("r.greedy") == "r.greedy"
    with pytest.raises(RunNotFoundError):
        lanes.folder("unknown")


# --- numpy state specs ---------------------------------------------------------------------

MANIFEST = Manifest((VariableSpec("a", "ca", "float32", (3,)), VariableSpec("b", "cb", "int64", ())))
X = "numpy_arrays/x/.ATTRIBUTES/py_state"
Y = "numpy_arrays/y/.ATTRIBUTES/py_state"


def test_a_numpy_state_adds_its_entries_after_the_variables() -> None:
    spec = NumpyStateSpec(b"graph", (NumpyEntry(X, 10), NumpyEntry(Y, 0)))

    assert spec.nbytes == 10
    assert spec.offsets(MANIFEST.nbytes) == [(20, 30), (30, 30)]
    check_payload(MANIFEST, MANIFEST.variables, 30, spec, max_bytes=30)
    with pytest.raises(InvalidRequestError, match="numpy state 10"):
        check_payload(MANIFEST, MANIFEST.variables, 20, spec)
    with pytest.raises(LimitExceededError):
        check_payload(MANIFEST, MANIFEST.variables, 30, spec, max_bytes=29)
    with pytest.raises(InvalidRequestError, match="'b'"):
        check_payload(MANIFEST, MANIFEST.variables[:1], 30, spec)


@pytest.mark.parametrize(
    ("graph", "entries", "match"),
    [
        (b"", (NumpyEntry(X, 1),), "object graph is empty"),
        (b"g", (NumpyEntry("policy/x", 1),), "does not start with"),
        (b"g", (NumpyEntry(X, 1), NumpyEntry(X, 2)), "appears twice"),
        (b"g", (NumpyEntry(X, -1),), "negative"),
    ],
)
def test_bad_numpy_state_specs_are_refused(graph: bytes, entries: tuple, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        NumpyStateSpec(graph, entries)


def test_a_numpy_payload_must_hold_exactly_its_entries() -> None:
    spec = NumpyStateSpec(b"graph", (NumpyEntry(X, 4),))
    assert NumpyPayload(spec, b"1234").data == b"1234"
    with pytest.raises(InvalidRequestError):
        NumpyPayload(spec, b"123")
