"""The in-place restore's links dirs of trainers that died without close() are swept by the next one on the host."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from checkpointd_client.restore import held_files as in_place


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_dirs_of_processes_that_are_gone_are_removed_and_no_other(tmp_path: Path) -> None:
    dead, alive = _dead_pid(), os.getppid()
    named_dead = tmp_path / f"{in_place.DIR_PREFIX}{dead}-abc"
    named_alive = tmp_path / f"{in_place.DIR_PREFIX}{alive}-def"
    older_dead = tmp_path / f"{in_place.DIR_PREFIX}xyz"  # an older client's: no pid in its name
    (older_dead / "train").mkdir(parents=True)
    (older_dead / "train" / "ckpt-1.index").symlink_to(f"/proc/{dead}/fd/7")
    unknown = tmp_path / f"{in_place.DIR_PREFIX}empty"  # owner cannot be told: left alone
    other = tmp_path / "checkpointd-restore-123-x"
    for d in (named_dead, named_alive, unknown, other):
        d.mkdir()
    assert in_place.sweep(str(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (named_alive, unknown, other))


def test_a_missing_parent_sweeps_nothing(tmp_path: Path) -> None:
    assert in_place.sweep(str(tmp_path / "absent")) == 0
