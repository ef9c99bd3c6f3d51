"""checkpointd.protocol.busy_lock: each holder's own file description contends with the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpointd.protocol.busy_lock import BusyLock


def test_two_holders_of_one_file_contend_and_a_release_frees_it(tmp_path: Path) -> None:
    path = str(tmp_path / "run.lock")
    daemon, trainer = BusyLock(path, create=True), BusyLock(path)
    try:
        assert trainer.try_take()
        assert not daemon.try_take()  # another file description holds it
        trainer.release()
        assert daemon.try_take()
        assert not trainer.try_take()
    finally:
        daemon.close()
        trainer.close()


def test_closing_a_holder_lets_go_of_its_lock(tmp_path: Path) -> None:
    path = str(tmp_path / "run.lock")
    first, second = BusyLock(path, create=True), BusyLock(path)
    assert first.try_take()
    first.close()  # as a process that dies
    try:
        assert second.try_take()
    finally:
        second.close()


def test_stale_once_the_file_is_removed_and_create_refuses_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "run.lock"
    made = BusyLock(str(path), create=True)
    opened = BusyLock(str(path))
    try:
        assert not opened.stale()
        with pytest.raises(FileExistsError):
            BusyLock(str(path), create=True)
        assert path.stat().st_mode & 0o777 == 0o600
        path.unlink()
        assert opened.stale() and made.stale()
    finally:
        made.close()
        opened.close()
