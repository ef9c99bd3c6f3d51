"""Run names and export dirs: what a client may name, and where a save lands."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import pytest

from checkpointd.core.ports import CommittedSave
from checkpointd.durable import make_temp_sibling, publish_dir
from checkpointd.protocol.errors import InvalidRequestError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import (
    MAX_EXPORT_NAME_BYTES,
    NAME_MAX_BYTES,
    OLD_PREFIX,
    RETIRED_PREFIX,
    SUFFIX_HEX_LEN,
    TMP_PREFIX,
    check_export_dir,
    check_run_name,
)
from checkpointd.storage.local import LocalStore
from checkpointd.storage.local_paths import resolve_export_dir


@pytest.mark.parametrize("run", ["a", "run-1", "A.b_c-9", "7", "x" * 128])
def test_valid_run_names(run: str) -> None:
    assert check_run_name(run) == run


@pytest.mark.parametrize(
    "run",
    ["", ".hidden", "-dash", "_under", "a/b", "a\\b", "x" * 129, "résumé", "a b", "a\n"] + ["..", "."],
)
def test_invalid_run_names(run: str) -> None:
    with pytest.raises(InvalidRequestError):
        check_run_name(run)


@pytest.mark.parametrize(
    ("export_dir", "normalized"),
    [
        ("policy", "policy"),
        ("policies/step_100/saved", "policies/step_100/saved"),
        ("./a", "a"),
        ("a/./b", "a/b"),
        ("a//b/", "a/b"),
        ("x" * 213, "x" * 213),
        ("x" * 255 + "/last", "x" * 255 + "/last"),  # only the last component gets derived names
        ("ü-步", "ü-步"),
    ],
)
def test_accepted_export_dirs_are_normalized(export_dir: str, normalized: str) -> None:
    assert check_export_dir(export_dir) == PurePosixPath(normalized)


@pytest.mark.parametrize(
    "export_dir",
    [
        "",
        ".",
        "./",
        "/abs",
        "//net/share",
        "..",
        "../x",
        "a/..",
        "a/../b",
        "a/b/../../..",
        "a\\b",
        "..\\x",
        "a\x00b",
        "a\nb",
        "a\tb",
        "a\x1bb",
        "a\x7fb",
        "evil\u202etxt.exe",
        "zero\u200bwidth",
        ".checkpointd",
        ".checkpointd-tmp-1",
        "a/.checkpointd.bak",
        "x" * 256,
        "x" * 256 + "/last",
        "x" * 214,
        "a/" + "ü" * 107,  # 214 bytes of UTF-8 in 107 characters
        "a/" * 512 + "b",
    ],
    ids=repr,
)
def test_refused_export_dirs(export_dir: str) -> None:
    with pytest.raises(InvalidRequestError):
        check_export_dir(export_dir)


def test_a_too_long_last_component_is_refused_naming_the_limit() -> None:
    with pytest.raises(InvalidRequestError, match=rf"214 bytes .* at most {MAX_EXPORT_NAME_BYTES}\b"):
        check_export_dir("policies/" + "x" * 214)


def test_the_limit_leaves_room_for_every_name_the_store_derives() -> None:
    longest = max(len(p) for p in (TMP_PREFIX, OLD_PREFIX, RETIRED_PREFIX)) + 1 + SUFFIX_HEX_LEN
    assert MAX_EXPORT_NAME_BYTES + longest == NAME_MAX_BYTES == 255
    assert MAX_EXPORT_NAME_BYTES == 213


def test_a_save_at_the_longest_name_is_staged_replaced_and_retired_on_a_real_disk(tmp_path: Path) -> None:
    # Every name the local store derives from a 213-byte name must fit the
    # filesystem: a write, a replacement (the old tree parked), a retirement.
    store = LocalStore(tmp_path, fsync=False)
    try:
        name = "x" * MAX_EXPORT_NAME_BYTES
        target = store.target("run-1", name)
        for generation in ("first", "second"):
            staging = make_temp_sibling(target)
            (staging / "gen").write_text(generation)
            publish_dir(staging, target, fsync=False)  # the second parks the first as .checkpointd-old-
        assert (target / "gen").read_text() == "second"
        save = CommittedSave(target, name, "run-1", SaveKind.CHECKPOINT, 1, 0.0)
        assert store.delete(save)  # renamed to .checkpointd-tmp-retired-<name>-<hex> first
        assert list((tmp_path / "run-1").iterdir()) == []
    finally:
        store.close()


def test_reserved_prefix_only_at_the_start_of_a_component() -> None:
    assert check_export_dir("a.checkpointd/b") == PurePosixPath("a.checkpointd/b")


def test_resolved_export_dir_is_under_root_and_run(tmp_path: Path) -> None:
    target = resolve_export_dir(tmp_path, "run-1", "./policies/step_5")

    run_dir = Path(os.path.realpath(tmp_path / "run-1"))
    assert target == run_dir / "policies" / "step_5"
    assert target.is_absolute()


def test_resolve_refuses_a_bad_run_name_or_export_dir(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError):
        resolve_export_dir(tmp_path, "../up", "policy")
    with pytest.raises(InvalidRequestError):
        resolve_export_dir(tmp_path, "run-1", "../run-2/policy")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "root" / "run-1"
    run_dir.mkdir(parents=True)
    return run_dir


def test_symlink_inside_the_run_pointing_outside_is_refused(tmp_path: Path, run_dir: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (run_dir / "escape").symlink_to(outside)

    with pytest.raises(InvalidRequestError, match="symlink"):
        resolve_export_dir(run_dir.parent, "run-1", "escape")
    with pytest.raises(InvalidRequestError, match="symlink"):
        resolve_export_dir(run_dir.parent, "run-1", "escape/deeper/policy")


def test_a_symlink_deeper_in_the_export_dir_pointing_outside_is_refused(tmp_path: Path, run_dir: Path) -> None:
    (tmp_path / "outside").mkdir()
    (run_dir / "policies" / "real").mkdir(parents=True)
    (run_dir / "policies" / "escape").symlink_to(tmp_path / "outside")

    with pytest.raises(InvalidRequestError, match="symlink"):
        resolve_export_dir(run_dir.parent, "run-1", "policies/escape/policy_5")
    # Real dirs all the way, or not there yet: the path as given, under the run's real folder.
    real_run = Path(os.path.realpath(run_dir))
    assert resolve_export_dir(run_dir.parent, "run-1", "policies/real/policy_5") == real_run / "policies/real/policy_5"
    assert resolve_export_dir(run_dir.parent, "run-1", "absent/policy_5") == real_run / "absent/policy_5"


def test_dangling_symlink_pointing_outside_is_refused(tmp_path: Path, run_dir: Path) -> None:
    (run_dir / "later").symlink_to(tmp_path / "not-yet")

    with pytest.raises(InvalidRequestError):
        resolve_export_dir(run_dir.parent, "run-1", "later/policy")


def test_symlink_into_a_sibling_run_is_refused(run_dir: Path) -> None:
    other = run_dir.parent / "run-2"
    other.mkdir()
    (run_dir / "neighbour").symlink_to(other)

    with pytest.raises(InvalidRequestError):
        resolve_export_dir(run_dir.parent, "run-1", "neighbour/policy")


def test_symlink_pointing_inside_the_run_is_allowed(run_dir: Path) -> None:
    (run_dir / "real" / "deep").mkdir(parents=True)
    (run_dir / "latest").symlink_to(run_dir / "real")

    target = resolve_export_dir(run_dir.parent, "run-1", "latest/deep/policy")

    real_run = Path(os.path.realpath(run_dir))
    assert target == real_run / "latest" / "deep" / "policy"
    assert Path(os.path.realpath(target)).parent == real_run / "real" / "deep"
