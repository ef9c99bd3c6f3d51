"""checkpointd.storage.ownership: one holder of a daemon's dir at a time, named to the next one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpointd.storage.ownership import LOCK_NAME, DirInUseError, DirLock, Holder

STARTED = 1_796_160_605.0  # 2026-12-01 21:30:05 UTC


def _take(state_dir: Path, **who: object) -> DirLock:
    return DirLock.take(state_dir, what=f"the root {state_dir.parent}", flag="--root", **who)  # type: ignore[arg-type]


def test_a_second_taker_is_refused_with_the_holders_pid_host_and_start_and_the_flag(tmp_path: Path) -> None:
    with _take(tmp_path, pid=4242, host="node-a", now=STARTED):
        with pytest.raises(DirInUseError) as refused:
            _take(tmp_path, pid=99, host="node-b")
    assert refused.value.holder == Holder(4242, "node-a", STARTED)
    message = str(refused.value)
    assert f"the root {tmp_path.parent} is in use by another checkpointd" in message
    assert "pid 4242 on host node-a, running since 2026-12-01 21:30:05 UTC" in message
    assert message.endswith("stop that daemon, or give this one another --root")
    assert isinstance(refused.value, OSError)  # serve reports it as "cannot start", exit 2


def test_a_release_frees_the_lock_and_the_next_holder_writes_itself(tmp_path: Path) -> None:
    first = _take(tmp_path, pid=1, host="a", now=STARTED)
    first.release()
    first.release()  # idempotent
    assert not first.held
    with _take(tmp_path, pid=2, host="b", now=STARTED + 60) as second:
        assert second.held
        written = json.loads((tmp_path / LOCK_NAME).read_text())
    assert written == {"pid": 2, "host": "b", "started": STARTED + 60}  # the old holder's longer line is gone


def test_the_default_holder_is_this_process(tmp_path: Path) -> None:
    import os
    import socket

    with _take(tmp_path):
        with pytest.raises(DirInUseError) as refused:
            _take(tmp_path)
    assert refused.value.holder is not None
    assert (refused.value.holder.pid, refused.value.holder.host) == (os.getpid(), socket.gethostname())


@pytest.mark.parametrize("content", [b"", b"{half", b"[1, 2]", b'{"pid": "x", "host": "h", "started": 0}'])
def test_a_holder_that_has_not_written_itself_yet_is_described_as_starting(tmp_path: Path, content: bytes) -> None:
    with _take(tmp_path) as lock:
        lock.path.write_bytes(content)  # a holder between its flock and its write, or a foreign file
        with pytest.raises(DirInUseError) as refused:
            _take(tmp_path)
    assert refused.value.holder is None
    assert "in use by another checkpointd (a daemon starting right now)" in str(refused.value)


def test_a_lock_left_by_a_dead_holder_is_taken_at_once(tmp_path: Path) -> None:
    # What a killed daemon leaves: the file with its pid, and no flock (the kernel dropped it).
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "gone", "started": STARTED}))
    with _take(tmp_path, pid=7, host="here", now=STARTED) as lock:
        assert lock.held
        assert json.loads(lock.path.read_text())["pid"] == 7


def test_a_state_dir_that_cannot_hold_the_file_raises_the_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        _take(tmp_path / "missing")
