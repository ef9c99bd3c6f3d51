"""Training checkpoint dirs on the local store: prefix commits, the state file, retention, recovery.

Real `LocalStore` and `CheckpointDirs` on a temp dir, with stand-in files
for the TensorFlow ones (the store never reads them): what is committed,
what the `checkpoint` file names after each step, what `verify` says.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath

import pytest

from checkpointd.cli.verify import verify_paths
from checkpointd.core import checkpoint_state
from checkpointd.core.checkpoint_spec import CheckpointRetention
from checkpointd.core.ports import SaveMeta, Staged
from checkpointd.core.retention import RetentionPolicy
from checkpointd.protocol.kinds import SaveKind
from checkpointd.saves.checkpoint_dirs import RULES_FIELD, CheckpointDirs
from checkpointd.saves.retention import Retention
from checkpointd.storage.local import LocalStore

FOLDER, RUN, DIR = "job", "job.train", "train/checkpoints"


def _commit(
    store: LocalStore,
    dirs: CheckpointDirs,
    step: int,
    rules: CheckpointRetention | None = None,
    *,
    run: str = RUN,
    directory: str = DIR,
) -> Path:
    export_dir = f"{directory}/ckpt-{step}"
    target = store.target(FOLDER, export_dir)
    staging = store.stage(target)
    (staging / "ckpt.index").write_bytes(b"index %d" % step)
    (staging / "ckpt.data-00000-of-00001").write_bytes(b"data %d" % step * 10)
    rules = rules or CheckpointRetention()
    extra = {RULES_FIELD: {"max_to_keep": rules.max_to_keep, "keep_checkpoint_every_n_hours": None}}
    staged = Staged(staging, 0, {"test": "1"}, extra=extra, files_prefix="ckpt")
    dirs.replacing(FOLDER, export_dir)
    store.commit(staged, target, SaveMeta(run, SaveKind.TRAINING_CHECKPOINT, step, export_dir))
    dirs.committed(FOLDER, export_dir)
    return target


def _state(root: Path) -> list[str]:
    text = (root / FOLDER / DIR / checkpoint_state.STATE_FILE).read_text()
    return [line.split('"')[1] for line in text.splitlines() if line.startswith("all_model_checkpoint_paths")]


def _files(root: Path) -> list[str]:
    return sorted(os.listdir(root / FOLDER / DIR))


def test_a_prefix_save_is_committed_beside_the_others_with_its_manifest_last(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    dirs = CheckpointDirs(store)
    for step in (3, 5):
        _commit(store, dirs, step)
    assert _files(tmp_path) == [
        "checkpoint",
        "ckpt-3.checkpointd.manifest.json",
        "ckpt-3.data-00000-of-00001",
        "ckpt-3.index",
        "ckpt-5.checkpointd.manifest.json",
        "ckpt-5.data-00000-of-00001",
        "ckpt-5.index",
    ]
    assert _state(tmp_path) == ["ckpt-3", "ckpt-5"]
    saves = sorted(store.committed(FOLDER, RUN), key=lambda s: s.step)
    assert [(s.export_dir, s.prefix, s.kind) for s in saves] == [
        (f"{DIR}/ckpt-3", True, SaveKind.TRAINING_CHECKPOINT),
        (f"{DIR}/ckpt-5", True, SaveKind.TRAINING_CHECKPOINT),
    ]
    assert store.committed_at(FOLDER, f"{DIR}/ckpt-5").path == tmp_path.resolve() / FOLDER / DIR / "ckpt-5"
    reports = verify_paths([tmp_path])
    assert [(Path(r.path).name, r.ok) for r in reports] == [("ckpt-3", True), ("ckpt-5", True)]


def test_retention_deletes_the_oldest_past_max_to_keep_and_the_state_file_follows(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    dirs = CheckpointDirs(store)
    retention = Retention(store, RetentionPolicy(keep_last=1), dirs)  # --keep-last does not apply here
    for step in range(4):
        _commit(store, dirs, step)
        retention.tidy(RUN, FOLDER)
        retention.tidy_checkpoints(FOLDER, DIR, CheckpointRetention(2, None))
        kept = [f"ckpt-{s}" for s in range(max(0, step - 1), step + 1)]
        assert _state(tmp_path) == kept
        assert sorted({f.split(".")[0] for f in _files(tmp_path) if f.startswith("ckpt")}) == kept
    assert dirs.deleted == 2


def test_saving_the_same_step_again_replaces_it_and_moves_it_last(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    dirs = CheckpointDirs(store)
    for step in (1, 2, 1):
        _commit(store, dirs, step)
    assert _state(tmp_path) == ["ckpt-2", "ckpt-1"]
    assert len(store.committed(FOLDER, RUN)) == 2


def test_recovery_names_a_checkpoint_the_state_file_missed_and_applies_its_recorded_rules(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    dirs = CheckpointDirs(store)
    for step in (1, 2):
        _commit(store, dirs, step, CheckpointRetention(1, None))
    # The daemon died after committing ckpt-3, before its state file and sweep.
    target = store.target(FOLDER, f"{DIR}/ckpt-3")
    staging = store.stage(target)
    (staging / "ckpt.index").write_bytes(b"i")
    extra = {RULES_FIELD: {"max_to_keep": 1, "keep_checkpoint_every_n_hours": None}}
    store.commit(
        Staged(staging, 0, {}, extra=extra, files_prefix="ckpt"),
        target,
        SaveMeta(RUN, SaveKind.TRAINING_CHECKPOINT, 3, f"{DIR}/ckpt-3"),
    )
    assert _state(tmp_path) == ["ckpt-1", "ckpt-2"]

    assert CheckpointDirs(store).recover() == 2
    assert _state(tmp_path) == ["ckpt-3"]
    assert [s.step for s in store.committed(FOLDER, RUN)] == [3]


def test_taking_a_run_over_sweeps_its_dirs_by_their_recorded_rules_and_no_other_runs(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    dirs = CheckpointDirs(store)
    # The last holder died after committing ckpt-4 of a max_to_keep=3 dir, before its sweep.
    for step in range(1, 5):
        _commit(store, dirs, step, CheckpointRetention(3, None))
    for step in (1, 2):  # another run's dir in the same folder, also past its rules: not this run's to tidy
        _commit(store, dirs, step, CheckpointRetention(1, None), run="job.other", directory="other")
    assert len(store.committed(FOLDER, RUN)) == 4

    retention = Retention(store, RetentionPolicy(), dirs)
    assert retention.take_over(RUN, FOLDER) == 1
    assert _state(tmp_path) == ["ckpt-2", "ckpt-3", "ckpt-4"]
    assert sorted(s.step for s in store.committed(FOLDER, RUN)) == [2, 3, 4]
    assert sorted(s.step for s in store.committed(FOLDER, "job.other")) == [1, 2]
    assert retention.take_over(RUN, FOLDER) == 0  # as its rules keep it: nothing more


def test_files_left_without_a_manifest_fail_verify_and_do_not_count(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    dirs = CheckpointDirs(store)
    _commit(store, dirs, 1)
    (tmp_path / FOLDER / DIR / "ckpt-2.index").write_bytes(b"cut short")
    assert [s.step for s in store.committed(FOLDER, RUN)] == [1]
    reports = {Path(r.path).name: r for r in verify_paths([tmp_path / FOLDER])}
    assert reports["ckpt-1"].ok and not reports["ckpt-2"].ok
    assert "no ckpt-2.checkpointd.manifest.json" in reports["ckpt-2"].reason
    assert _state(tmp_path) == ["ckpt-1"]


def test_verify_names_a_changed_file_of_a_prefix(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    target = _commit(store, CheckpointDirs(store), 4)
    target.with_name("ckpt-4.index").write_bytes(b"tampered!")
    (report,) = verify_paths([target])
    assert not report.ok and "ckpt-4.index has 9 bytes" in report.reason


def _committed(
    tmp_path: Path, steps: range, rules: CheckpointRetention | None = None
) -> tuple[LocalStore, CheckpointDirs]:
    """A store at `tmp_path` with a checkpoint of each of `steps` committed in DIR."""
    store = LocalStore(tmp_path, fsync=False)
    dirs = CheckpointDirs(store)
    for step in steps:
        _commit(store, dirs, step, rules)
    return store, dirs


def test_a_sweep_writes_the_state_file_once_and_again_only_for_a_victim_that_stayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, dirs = _committed(tmp_path, range(3))
    writes: list[list[str]] = []
    write_file = store.write_file

    def counted(path: PurePath, data: bytes) -> None:
        writes.append(
            [line.split('"')[1] for line in data.decode().splitlines() if line.startswith("all_model_checkpoint_paths")]
        )
        write_file(path, data)

    monkeypatch.setattr(store, "write_file", counted)
    assert dirs.tidy(FOLDER, DIR, CheckpointRetention(2, None)) == 1
    assert writes == [["ckpt-1", "ckpt-2"]]  # without ckpt-0, before it went; nothing left to say after
    assert _state(tmp_path) == ["ckpt-1", "ckpt-2"]

    _commit(store, dirs, 3)
    writes.clear()
    monkeypatch.setattr(store, "delete", lambda save: False)  # ckpt-1's delete fails: it stays
    assert dirs.tidy(FOLDER, DIR, CheckpointRetention(2, None)) == 0
    assert writes == [["ckpt-2", "ckpt-3"], ["ckpt-1", "ckpt-2", "ckpt-3"]]
    assert _state(tmp_path) == ["ckpt-1", "ckpt-2", "ckpt-3"]


def test_a_dir_that_keeps_every_checkpoint_is_not_even_listed_by_its_retention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, dirs = _committed(tmp_path, range(3), CheckpointRetention(None, None))
    touched: list[str] = []
    for name in ("committed", "read_file", "write_file", "delete"):
        real = getattr(store, name)
        monkeypatch.setattr(store, name, lambda *a, _n=name, _r=real, **k: (touched.append(_n), _r(*a, **k))[1])
    assert dirs.tidy(FOLDER, DIR, CheckpointRetention(None, None)) == 0
    assert touched == []  # as CheckpointManager._sweep: max_to_keep=None keeps all and reads nothing
    assert _state(tmp_path) == ["ckpt-0", "ckpt-1", "ckpt-2"]
    assert dirs.tidy(FOLDER, DIR, CheckpointRetention(2, None)) == 1  # the same dir, with a limit: swept
    assert "committed" in touched
