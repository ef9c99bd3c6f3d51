"""Runs `checkpointd` with its group commit's shared syncs slowed, so a crash test can kill inside them.

`python -m tests.integration.support.slow_sync SECONDS -- python -m checkpointd serve ...`
runs the daemon in this process (same pid, so SIGKILL hits it) after
wrapping `checkpointd.durable.group_commit.syncfs_of`: every shared sync
waits SECONDS before it syncs. A small save's commit is then two wide
windows a kill can land in: its files and manifest written in the staging
dir, the first sync pending (`batched`); the staging dir renamed into
place, the second sync pending (`published`). The daemon's code is not
changed; only the time its syncs take.

`python -m tests.integration.support.slow_sync SECONDS --fsync -- ...` also makes
every `os.fsync` wait SECONDS first: a slowed disk for the saves that are
not group-committed (a training checkpoint's files, each fsynced).
"""

from __future__ import annotations

import os
import runpy
import sys
import threading

from checkpointd.durable import group_commit


def main() -> None:
    seconds, args = float(sys.argv[1]), sys.argv[2:]
    fsync = args[:1] == ["--fsync"]
    sep, command = args[fsync], args[fsync + 1 :]
    if sep != "--" or command[1:2] != ["-m"]:
        raise SystemExit(
            "usage: python -m tests.integration.support.slow_sync SECONDS [--fsync] -- python -m MODULE ARGS..."
        )
    real = group_commit.syncfs_of
    if fsync:
        real_fsync = os.fsync

        def slow_fsync(fd: int) -> None:
            threading.Event().wait(seconds)  # the disk's time
            real_fsync(fd)

        os.fsync = slow_fsync  # type: ignore[assignment]

    def slowed(directory):  # type: ignore[no-untyped-def]
        sync = real(directory)
        if sync is None:
            return None

        def slow() -> None:
            threading.Event().wait(seconds)  # the window a kill may land in
            sync()

        return slow

    group_commit.syncfs_of = slowed  # type: ignore[assignment]
    sys.argv = [command[2], *command[3:]]
    runpy.run_module(command[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
