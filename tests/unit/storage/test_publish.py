"""Atomic directory publication and start-up recovery, on real files, no TF."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from checkpointd import durable
from checkpointd.core.ports import SaveMeta, Staged
from checkpointd.protocol.errors import SaveFailedError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import MANIFEST_NAME
from checkpointd.storage import local

_HEX = "0123456789abcdef"


def tree(root: Path) -> dict[str, str]:
    """Relative path -> content of every file under root."""
    return {os.path.relpath(os.path.join(d, f), root): Path(d, f).read_text() for d, _, fs in os.walk(root) for f in fs}


def make(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_publish_imports_only_the_stdlib_and_the_core() -> None:
    code = (
        "import sys, checkpointd.durable, checkpointd.storage.local; "
        "sys.exit(any(m.split('.')[0] in ('tensorflow', 'numpy', 'grpc') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_temp_sibling_is_a_fresh_dir_next_to_the_target(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "export"
    first, second = durable.make_temp_sibling(target), durable.make_temp_sibling(target)
    assert first.is_dir() and second.is_dir() and first != second
    assert first.parent == target.parent
    assert re.fullmatch(r"\.checkpointd-tmp-export-[0-9a-f]+", first.name)
    assert not target.exists()


def test_temp_sibling_under_a_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("x")
    with pytest.raises(NotADirectoryError, match="blocker"):
        durable.make_temp_sibling(tmp_path / "blocker" / "export")


def test_publish_to_an_absent_target_renames_the_tree(tmp_path: Path) -> None:
    target = tmp_path / "export"
    tmp = make(durable.make_temp_sibling(target), {"a.txt": "new", "sub/b.txt": "new b"})
    durable.publish_dir(tmp, target)
    assert tree(target) == {"a.txt": "new", "sub/b.txt": "new b"}
    assert os.listdir(tmp_path) == ["export"]


def test_publish_over_a_directory_replaces_it_completely(tmp_path: Path) -> None:
    target = make(tmp_path / "export", {"stale.txt": "old", "a.txt": "old a", "old/c.txt": "c"})
    tmp = make(durable.make_temp_sibling(target), {"a.txt": "new a"})
    durable.publish_dir(tmp, target, fsync=False)
    assert tree(target) == {"a.txt": "new a"}
    assert os.listdir(tmp_path) == ["export"]


@pytest.mark.parametrize("kind", ["file", "symlink_to_file", "symlink_to_dir"])
def test_publish_over_a_non_directory_fails_and_touches_nothing(tmp_path: Path, kind: str) -> None:
    make(tmp_path, {"real.txt": "keep", "real_dir/x.txt": "keep x"})
    target = tmp_path / "export"
    if kind == "file":
        target.write_text("keep me")
    else:
        target.symlink_to(tmp_path / ("real.txt" if kind == "symlink_to_file" else "real_dir"))
    tmp = make(durable.make_temp_sibling(target), {"a.txt": "new"})
    with pytest.raises(SaveFailedError, match="not a directory"):
        durable.publish_dir(tmp, target)
    assert tree(tmp) == {"a.txt": "new"}  # left for the caller to remove
    if kind == "file":
        assert target.read_text() == "keep me"
    else:
        assert target.is_symlink()
    assert tree(tmp_path / "real_dir") == {"x.txt": "keep x"}


def test_a_failed_second_rename_puts_the_old_tree_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = make(tmp_path / "export", {"a.txt": "old"})
    tmp = make(durable.make_temp_sibling(target), {"a.txt": "new"})
    real_rename = os.rename

    def rename(src: str, dst: str, **dir_fds: int) -> None:
        if Path(src) == tmp:
            raise OSError(28, "No space left on device", str(src))
        real_rename(src, dst, **dir_fds)

    monkeypatch.setattr(durable.files.os, "rename", rename)
    with pytest.raises(OSError, match="No space"):
        durable.publish_dir(tmp, target, fsync=False)
    assert tree(target) == {"a.txt": "old"}
    assert sorted(os.listdir(tmp_path)) == sorted(["export", tmp.name])


def test_fsync_tree_syncs_a_tree_and_a_single_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make(tmp_path / "t", {"a.txt": "a", "d/e/b.txt": "b"})
    (root / "d" / "link").symlink_to(tmp_path / "missing")  # dangling: must not be opened
    opened: dict[int, str] = {}
    synced: list[str] = []
    real_open = os.open

    def recording_open(path: str | os.PathLike[str], flags: int, *args: int) -> int:
        fd = real_open(path, flags, *args)
        opened[fd] = os.path.relpath(path, root)
        return fd

    monkeypatch.setattr(os, "open", recording_open)
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(opened[fd]))

    durable.fsync_tree(root)

    # Every file and dir once, contents before their dir, the link never opened.
    assert sorted(synced) == sorted([".", "a.txt", "d", os.path.join("d", "e"), os.path.join("d", "e", "b.txt")])
    for inner, outer in [
        (os.path.join("d", "e", "b.txt"), os.path.join("d", "e")),
        (os.path.join("d", "e"), "d"),
        ("d", "."),
        ("a.txt", "."),
    ]:
        assert synced.index(inner) < synced.index(outer)
    synced.clear()
    durable.fsync_tree(root / "a.txt")
    assert synced == ["a.txt"]


def test_a_commit_fsyncs_every_file_and_dir_once_its_dir_after_the_manifest_all_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = local.LocalStore(tmp_path / "root")
    target = store.target("run1", "policy_3")
    staging = make(store.stage(target), {"saved_model.pb": "g", "variables/variables.index": "i"})
    (staging / "assets").mkdir()
    events: list[str] = []
    real_staging = os.readlink(staging)  # the store hands out a path naming its open staging dir
    real_rename = os.rename

    def name(path: str) -> str:
        return os.path.relpath(path, real_staging) if Path(path).is_relative_to(real_staging) else str(path)

    def where(fd: int) -> str:  # what an fd is open on, named as the test names it
        return name(os.readlink(f"/proc/self/fd/{fd}"))

    def recording_rename(src: str, dst: str, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        shown = (
            src if src_dir_fd is None or os.path.isabs(src) else os.readlink(f"/proc/self/fd/{src_dir_fd}") + "/" + src
        )
        events.append(f"rename {name(shown)}")
        real_rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(os, "rename", recording_rename)
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(f"fsync {where(fd)}"))
    meta = SaveMeta("run1", SaveKind.SAVED_MODEL, 3, "policy_3")
    try:
        store.commit(Staged(staging, 2, {"checkpointd": "0"}), target, meta)
    finally:
        store.close()

    synced = [e.removeprefix("fsync ") for e in events if e.startswith("fsync ")]
    files = ["saved_model.pb", os.path.join("variables", "variables.index"), MANIFEST_NAME]
    dirs = [".", "variables", "assets"]
    assert sorted(synced) == sorted([*files, *dirs, str(target.parent)])  # each once, the run's folder too
    assert synced.index(".") > synced.index(MANIFEST_NAME)  # its last entry
    assert synced.index(".") > max(synced.index("variables"), synced.index("assets"))
    assert synced.index("variables") > synced.index(os.path.join("variables", "variables.index"))
    assert events[-2:] == ["rename .", f"fsync {target.parent}"]
    assert (target / MANIFEST_NAME).is_file()


def test_remove_quietly_removes_trees_files_and_ignores_the_absent(tmp_path: Path) -> None:
    make(tmp_path, {"d/x.txt": "x", "f.txt": "f"})
    durable.remove_quietly(tmp_path / "d")
    durable.remove_quietly(tmp_path / "f.txt")
    durable.remove_quietly(tmp_path / "absent")
    assert os.listdir(tmp_path) == []


def test_recover_repairs_interrupted_publications_and_nothing_else(tmp_path: Path) -> None:
    root = tmp_path / "root"
    old, older = f".checkpointd-old-export-{_HEX}", f".checkpointd-old-kept-{_HEX}"
    make(
        root,
        {
            # A crash between the two renames: restore the old tree.
            f"run1/{old}/saved_model.pb": "old export",
            # A crash before the old tree was deleted: the new one is in place.
            f"run1/{older}/a.txt": "superseded",
            "run1/kept/a.txt": "current",
            # Unfinished writes, at any depth.
            "run1/.checkpointd-tmp-export-0a1b/variables/variables.index": "partial",
            "run2/deep/er/.checkpointd-tmp-x-ff/a": "partial",
            # Not ours: left alone.
            "run2/normal/a.txt": "n",
            "run2/.hidden/a.txt": "h",
            "run2/.checkpointd-old-nohex/a.txt": "malformed",
            "run2/.checkpointd-tmp-a-file-not-a-dir": "a file",
        },
    )
    outside = make(tmp_path / "outside", {".checkpointd-tmp-y-00/a": "via symlink"})
    (root / "run2" / "link").symlink_to(outside)

    assert durable.recover(root) == 4
    assert tree(root) == {
        "run1/export/saved_model.pb": "old export",
        "run1/kept/a.txt": "current",
        "run2/normal/a.txt": "n",
        "run2/.hidden/a.txt": "h",
        "run2/.checkpointd-old-nohex/a.txt": "malformed",
        "run2/.checkpointd-tmp-a-file-not-a-dir": "a file",
    }
    assert tree(outside) == {".checkpointd-tmp-y-00/a": "via symlink"}
    assert durable.recover(root) == 0


def test_recover_of_an_empty_or_absent_root_fixes_nothing(tmp_path: Path) -> None:
    assert durable.recover(tmp_path) == 0
    assert durable.recover(tmp_path / "absent") == 0


def test_a_staged_prefix_is_renamed_with_the_files_it_knows(tmp_path: Path) -> None:
    from checkpointd.storage import prefix

    make(tmp_path, {"stem.index": "i", "stem.data-00000-of-00001": "dd"})
    staged = Staged(
        path=tmp_path,
        bytes_written=3,
        versions={},
        known={"stem.index": (1, 7), "stem.data-00000-of-00001": (2, 9)},
        files_prefix="stem",
    )
    renamed = prefix.rename_staged_save(staged, "ckpt-3")
    assert tree(tmp_path) == {"ckpt-3.index": "i", "ckpt-3.data-00000-of-00001": "dd"}
    assert renamed.known == {"ckpt-3.index": (1, 7), "ckpt-3.data-00000-of-00001": (2, 9)}


def _staged_prefix(train: Path, name: str, content: str) -> Path:
    """A prefix save of `name` staged in `train` with its manifest written: what `prefix.publish` starts from."""
    from checkpointd.storage import save_manifest

    staging = make(train / f".checkpointd-tmp-{name}-{_HEX}", {f"{name}.index": f"index {content}"})
    make(staging, {f"{name}.data-00000-of-00001": f"data {content}"})
    save_manifest.write_manifest(staging, run="r", kind="checkpoint", step=0, export_dir="train", versions={})
    return staging


def _publish(staging: Path, name: str) -> None:
    from checkpointd.storage import prefix

    fd = os.open(staging.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        prefix.publish(staging, fd, staging.name, staging.parent / name, fsync=False)
    finally:
        os.close(fd)


@pytest.mark.parametrize("moved", [0, 1, 2])
def test_recover_deletes_what_an_interrupted_prefix_commit_left_so_the_prefix_is_absent_not_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moved: int
) -> None:
    from checkpointd.storage import prefix

    root = tmp_path / "root"
    train = root / "run" / "train"
    # ckpt-3 committed; ckpt-6 committed once, and being replaced by a new ckpt-6 when the daemon dies
    # after `moved` of its files were renamed into place.
    for name in ("ckpt-3", "ckpt-6"):
        _publish(_staged_prefix(train, name, "old"), name)
    committed = tree(train)
    make(train, {"ckpt-9.index": "a file of no save of ours: no manifest, no staging dir names it"})
    staging = _staged_prefix(train, "ckpt-6", "new")
    real_rename = os.rename
    renames: list[str] = []

    def rename(src, dst, **kwargs):  # noqa: ANN001, ANN202
        if len(renames) == moved:
            raise KeyboardInterrupt("the kill")  # publish catches no such thing: nothing after it runs
        renames.append(os.fspath(dst))
        return real_rename(src, dst, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        _publish(staging, "ckpt-6")
    monkeypatch.setattr(os, "rename", real_rename)
    assert not prefix.is_committed(train / "ckpt-6")  # the old one stopped counting before the first rename
    assert len([n for n in os.listdir(train) if n.startswith("ckpt-6.")]) == 2  # old, new, or one of each

    assert local.LocalStore(root, fsync=False).recover() == 1 + 2  # the staging dir; ckpt-6's two files
    assert tree(train) == {
        **{rel: text for rel, text in committed.items() if rel.startswith("ckpt-3.")},
        "ckpt-9.index": "a file of no save of ours: no manifest, no staging dir names it",
    }


def test_recover_keeps_a_prefix_whose_commit_ended_and_touches_no_other_staging(tmp_path: Path) -> None:
    root = tmp_path / "root"
    train = root / "run" / "train"
    _publish(_staged_prefix(train, "ckpt-3", "done"), "ckpt-3")
    committed = tree(train)
    # Killed before the empty staging dir's rmdir: the save counts.
    (train / f".checkpointd-tmp-ckpt-3-{_HEX}").mkdir()
    # A dir save's staging, its manifest written (it is published by one rename): only the dir goes.
    make(train, {f".checkpointd-tmp-policy-{_HEX}/saved_model.pb": "p", "policy.txt": "not the save's"})
    from checkpointd.storage import save_manifest

    save_manifest.write_manifest(
        train / f".checkpointd-tmp-policy-{_HEX}", run="r", kind="policy", step=0, export_dir="policy", versions={}
    )
    assert local.LocalStore(root, fsync=False).recover() == 2
    assert tree(train) == {**committed, "policy.txt": "not the save's"}
