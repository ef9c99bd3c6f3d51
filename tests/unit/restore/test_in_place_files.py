"""Files read in place, held open: deleted or replaced at their path, they still read as the daemon vouched.

`checkpointd_client.restore.held_files.hold` opens a save's files on the daemon's
host, each only if its fstat is the stat the daemon vouched for, and gives
a private dir of links to the open descriptors, which TensorFlow reads by
path later (deferred restorations). Real files in a temp dir; no TF.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from checkpointd.protocol import wire
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client.restore import held_files as in_place

INDEX = b"the index " * 100
DATA = os.urandom(1 << 16)


def _vouched(directory: Path, path: str) -> pb.RestoreFile:
    data = (directory / path).read_bytes()
    st = (directory / path).stat()
    return pb.RestoreFile(
        path=path, size=len(data), crc32c=wire.crc32c_of(data), device=st.st_dev, inode=st.st_ino,
        mtime_ns=st.st_mtime_ns,
    )  # fmt: skip


@pytest.fixture
def save(tmp_path: Path) -> pb.RestoreFilesHeader:
    (tmp_path / "ckpt-3.index").write_bytes(INDEX)
    (tmp_path / "ckpt-3.data-00000-of-00001").write_bytes(DATA)
    files = [_vouched(tmp_path, "ckpt-3.index"), _vouched(tmp_path, "ckpt-3.data-00000-of-00001")]
    return pb.RestoreFilesHeader(export_dir="train/ckpt-3", local_dir=str(tmp_path), files=files)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_held_files_read_the_vouched_bytes_after_their_path_is_deleted_or_replaced(
    save: pb.RestoreFilesHeader, tmp_path: Path
) -> None:
    held = in_place.hold(save)
    assert held is not None
    try:
        assert held.index == INDEX
        link = Path(held.directory) / "ckpt-3.data-00000-of-00001"
        assert link.read_bytes() == DATA
        (tmp_path / "ckpt-3.data-00000-of-00001").unlink()  # retention deleted the save
        (tmp_path / "new.index").write_bytes(b"x")
        os.replace(tmp_path / "new.index", tmp_path / "ckpt-3.index")  # another save of its name took its place
        assert link.read_bytes() == DATA
        assert (Path(held.directory) / "ckpt-3.index").read_bytes() == INDEX
    finally:
        held.close()
    assert not os.path.exists(held.directory)


def test_close_releases_every_descriptor_and_is_idempotent(save: pb.RestoreFilesHeader) -> None:
    before = _open_fds()
    held = in_place.hold(save)
    assert held is not None
    assert len(_open_fds() - before) == 2
    held.close()
    held.close()
    assert _open_fds() == before


def test_a_file_not_as_the_daemon_vouched_is_not_held_and_nothing_stays_open(
    save: pb.RestoreFilesHeader, tmp_path: Path
) -> None:
    before = _open_fds()
    data = tmp_path / "ckpt-3.data-00000-of-00001"
    data.write_bytes(DATA[::-1])  # rewritten since the daemon checked it: another mtime
    os.utime(data, ns=(1, 1))
    assert in_place.hold(save) is None
    assert _open_fds() == before


def test_an_index_that_does_not_match_its_crc32c_is_not_held(save: pb.RestoreFilesHeader) -> None:
    save.files[0].crc32c ^= 1
    assert in_place.hold(save) is None
    held = in_place.hold(save, check_index=False)  # a policy's files: checked as they are read
    assert held is not None
    held.close()


@pytest.mark.parametrize("path", ["../ckpt-3.index", "/etc/passwd"])
def test_a_path_outside_the_dir_or_an_unvouched_file_is_never_held(save: pb.RestoreFilesHeader, path: str) -> None:
    save.files[1].path = path
    assert in_place.hold(save) is None
    save.files[1].path = "ckpt-3.data-00000-of-00001"
    save.files[1].inode = 0  # not checked by the daemon
    assert in_place.hold(save) is None


def test_no_local_dir_means_nothing_to_read_in_place(save: pb.RestoreFilesHeader) -> None:
    save.local_dir = ""
    assert in_place.hold(save) is None


def test_files_in_a_subdir_keep_their_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "variables").mkdir()
    (tmp_path / "variables" / "variables.index").write_bytes(INDEX)
    header = pb.RestoreFilesHeader(local_dir=str(tmp_path), files=[_vouched(tmp_path, "variables/variables.index")])
    held = in_place.hold(header)
    assert held is not None
    try:
        assert (Path(held.directory) / "variables" / "variables.index").read_bytes() == INDEX
    finally:
        held.close()
