"""The store's committed saves, listed at every commit, parse each manifest once while it is unchanged.

Real `LocalStore` and `CheckpointDirs` on a temp dir; the parse is counted
by wrapping `save_manifest.read_manifest` (the one seam that reads a file).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from checkpointd.core.ports import CommittedSave
from checkpointd.protocol.kinds import SaveKind
from checkpointd.saves.checkpoint_dirs import CheckpointDirs
from checkpointd.storage import save_manifest
from checkpointd.storage.local import LocalStore
from checkpointd.storage.manifest_cache import ManifestCache, identity
from tests.unit.saves.test_checkpoint_dirs import DIR, FOLDER, _commit


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The manifests read from disk, by name, as they are read."""
    seen: list[str] = []
    real = save_manifest.read_manifest

    def counted(save_dir: Path, name: str = save_manifest.MANIFEST_NAME) -> dict:
        seen.append(name)
        return real(save_dir, name)

    monkeypatch.setattr(save_manifest, "read_manifest", counted)
    return seen


def test_listing_a_dir_again_reads_only_the_manifest_committed_since(tmp_path: Path, reads: list[str]) -> None:
    store = LocalStore(tmp_path, fsync=False)
    dirs = CheckpointDirs(store)
    for step in range(5):
        _commit(store, dirs, step)
    first = store.committed(FOLDER, None)
    assert sorted(s.step for s in first) == list(range(5))
    reads.clear()
    assert store.committed(FOLDER, None) == first  # the same saves, none parsed again
    assert reads == []
    _commit(store, dirs, 5)  # its commit lists the dir again: only ckpt-5's manifest is new
    reads.clear()
    assert sorted(s.step for s in store.committed(FOLDER, None)) == list(range(6))
    assert reads == []


def test_a_manifest_replaced_in_place_is_read_again_and_a_deleted_save_is_gone(
    tmp_path: Path, reads: list[str]
) -> None:
    store = LocalStore(tmp_path, fsync=False)
    dirs = CheckpointDirs(store)
    for step in range(3):
        _commit(store, dirs, step)
    store.committed(FOLDER, None)
    manifest = next((tmp_path / FOLDER / DIR).glob("ckpt-1*manifest*"))
    text = manifest.read_text().replace('"step": 1', '"step": 41')
    replacement = manifest.with_name("replacement")
    replacement.write_text(text)
    os.replace(replacement, manifest)  # a new file: another inode
    reads.clear()
    steps = sorted(s.step for s in store.committed(FOLDER, None))
    assert steps == [0, 2, 41]
    assert len(reads) == 1
    doomed = next(s for s in store.committed(FOLDER, None) if s.step == 0)
    assert store.delete(doomed)
    assert sorted(s.step for s in store.committed(FOLDER, None)) == [2, 41]


def test_a_manifest_swapped_for_a_link_is_not_taken_from_the_cache(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    dirs = CheckpointDirs(store)
    _commit(store, dirs, 0)
    _commit(store, dirs, 1)
    assert len(store.committed(FOLDER, None)) == 2
    manifest = next((tmp_path / FOLDER / DIR).glob("ckpt-1*manifest*"))
    decoy = tmp_path / "decoy.json"
    decoy.write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(decoy)
    assert [s.step for s in store.committed(FOLDER, None)] == [0]


def _save(step: int) -> CommittedSave:
    return CommittedSave(Path(f"/r/ckpt-{step}"), f"ckpt-{step}", "run", SaveKind.TRAINING_CHECKPOINT, step, 0.0, True)


def test_the_cache_answers_only_for_the_same_identity_and_keeps_its_limit(tmp_path: Path) -> None:
    cache = ManifestCache(limit=2)
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("a")
    b.write_text("b")
    ia, ib = identity(a.stat()), identity(b.stat())
    cache.put("a", ia, _save(1))
    assert cache.get("a", ia) == _save(1)
    assert cache.get("a", ib) is None  # another file in its place
    cache.put("b", ib, _save(2))
    cache.get("a", ia)  # a is now the most recently used
    cache.put("c", ib, _save(3))
    assert len(cache) == 2
    assert cache.get("b", ib) is None and cache.get("a", ia) == _save(1)
    with pytest.raises(ValueError, match="limit must be >= 1"):
        ManifestCache(limit=0)
