"""Retention: the pure choice of victims, and the worker's locking and deletes."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from checkpointd.core.retention import RetentionPolicy
from checkpointd.saves.retention import Retention
from checkpointd.storage import save_manifest
from checkpointd.storage.local import LocalStore


@dataclass(frozen=True)
class S:
    step: int
    created: float


def steps(saves: list[S]) -> list[int]:
    return sorted(s.step for s in saves)


def test_keeps_the_newest_n_by_creation_time() -> None:
    saves = [S(step, created=step) for step in range(1, 8)]
    assert steps(RetentionPolicy(keep_last=3).victims(saves)) == [1, 2, 3, 4]


def test_newest_means_created_last_even_if_its_step_is_lower() -> None:
    # A restarted trainer saves step 5 after step 9 was saved: 5 is the newest.
    saves = [S(9, created=1.0), S(5, created=2.0)]
    assert steps(RetentionPolicy(keep_last=1).victims(saves)) == [9]


def test_keep_every_steps_spares_older_multiples() -> None:
    saves = [S(step, created=step) for step in (10, 15, 20, 25, 30, 35, 40)]
    victims = RetentionPolicy(keep_last=2, keep_every_steps=20).victims(saves)
    assert steps(victims) == [10, 15, 25, 30]


def test_no_policy_deletes_nothing_and_bad_policies_are_refused() -> None:
    assert RetentionPolicy().victims([S(1, 1), S(2, 2)]) == []
    for kwargs in ({"keep_last": 0}, {"keep_every_steps": 0, "keep_last": 1}, {"keep_every_steps": 5}):
        with pytest.raises(ValueError):
            RetentionPolicy(**kwargs)


def _save(folder: Path, name: str, run: str, kind: str, step: int, created: float) -> Path:
    path = folder / name
    (path / "variables").mkdir(parents=True)
    (path / "variables" / "variables.index").write_bytes(b"x")
    document = {
        "format": 1,
        "run": run,
        "kind": kind,
        "step": step,
        "export_dir": name,
        "created_unix_seconds": created,
        "files": [],
    }
    (path / save_manifest.MANIFEST_NAME).write_text(json.dumps(document))
    return path


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # Manifests here are minimal; retention reads only run, kind, step, created.
    monkeypatch.setattr(
        save_manifest,
        "read_manifest",
        lambda d, name=save_manifest.MANIFEST_NAME: json.loads((d / name).read_text()),
    )
    (tmp_path / "r").mkdir()
    return tmp_path / "r"


def test_tidy_deletes_only_the_runs_committed_saves_past_the_policy(folder: Path) -> None:
    for step in range(1, 5):
        _save(folder, f"ck_{step}", "r", "checkpoint", step, created=step)
    _save(folder, "sm_1", "r", "saved_model", 1, created=1)
    _save(folder, "other_run", "other", "checkpoint", 0, created=0)
    (folder / "users_dir").mkdir()
    retention = Retention(LocalStore(folder.parent), RetentionPolicy(keep_last=2))
    assert retention.tidy("r", "r") == 2
    assert sorted(p.name for p in folder.iterdir()) == ["ck_3", "ck_4", "other_run", "sm_1", "users_dir"]


def test_tidy_waits_while_a_save_is_being_published_into_the_folder(folder: Path) -> None:
    for step in range(1, 4):
        _save(folder, f"ck_{step}", "r", "checkpoint", step, created=step)
    retention = Retention(LocalStore(folder.parent), RetentionPolicy(keep_last=1))
    done = threading.Event()
    with retention.holding("r"):
        worker = threading.Thread(target=lambda: (retention.tidy("r", "r"), done.set()))
        worker.start()
        assert not done.wait(0.3), "tidied while a save was being published"
        assert (folder / "ck_1").exists()
    assert done.wait(30)
    worker.join(30)
    assert sorted(p.name for p in folder.iterdir()) == ["ck_3"]


def test_the_worker_tidies_after_saves_without_blocking_them(folder: Path) -> None:
    for step in range(1, 4):
        _save(folder, f"ck_{step}", "r", "checkpoint", step, created=step)
    retention = Retention(LocalStore(folder.parent), RetentionPolicy(keep_last=1))
    retention.start()
    try:
        with retention.holding("r"):
            retention.after_save("r", "r")  # returns although the folder is locked
        retention.wait_idle()
        assert sorted(p.name for p in folder.iterdir()) == ["ck_3"]
        assert retention.deleted == 2
    finally:
        retention.stop(timeout=30)


def test_two_holders_share_a_folder_while_tidying_waits_for_both(folder: Path) -> None:
    _save(folder, "ck_1", "r", "checkpoint", 1, created=1)
    _save(folder, "ck_2", "r", "checkpoint", 2, created=2)
    retention = Retention(LocalStore(folder.parent), RetentionPolicy(keep_last=1))
    done = threading.Event()
    with retention.holding("r"), retention.holding("r"):  # a publish and a restore at once
        worker = threading.Thread(target=lambda: (retention.tidy("r", "r"), done.set()))
        worker.start()
        assert not done.wait(0.3)
    assert done.wait(30)
    worker.join(30)
    assert sorted(p.name for p in folder.iterdir()) == ["ck_2"]
