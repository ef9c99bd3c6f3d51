"""What the daemon takes of its host, for the composition root (server.py).

The lock of its local dir, the same-host shared-memory transport, the
training checkpoint dirs recovered at start, how incremental saves copy on
this root (a clone where the file system shares extents), and the port file.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from checkpointd.core.config import DEFAULT_SHM_ROOT, ServeConfig
from checkpointd.core.incremental_path import ChooserConfig, IncrementalPath, PathChooser
from checkpointd.core.ports import SaveFormat, Store
from checkpointd.durable.copies import shares_extents
from checkpointd.protocol.kinds import SaveKind
from checkpointd.saves.checkpoint_dirs import CheckpointDirs
from checkpointd.storage.local import LocalStore
from checkpointd.storage.ownership import DirLock
from checkpointd.transport.shm import SharedMemory

_LOGGER = logging.getLogger(__name__)


def incremental_paths(store: Store, choice: str) -> PathChooser:
    """How incremental saves copy from their base: server-side on an object store; on a local root, a clone
    where its file system shares extents (probed once), else a copy."""
    config = ChooserConfig(choice=choice)
    if not isinstance(store, LocalStore):
        return PathChooser(IncrementalPath.SERVER_COPY, config)
    clones = shares_extents(store.root)
    return PathChooser(IncrementalPath.CLONE if clones else IncrementalPath.COPY, config)


def own_dir(config: ServeConfig) -> DirLock:
    """Takes the lock of the daemon's local dir: the root, or an s3:// root's work dir.

    Raises:
        DirInUseError: another daemon holds it; the message names it and the flag to change.
    """
    if config.s3_url is None:
        what, flag = f"the root {config.root}", "--root"
    else:
        what = f"the work dir {config.root} (of s3:// roots' templates and staging)"
        flag = "--work-dir (each daemon on a host needs its own; the default is ./checkpointd-work)"
    return DirLock.take(config.state_dir, what=what, flag=flag)


def shared_memory(root: Path | None, max_bytes: int) -> SharedMemory | None:
    """The same-host snapshot transport, or None if it is off or cannot start (logged)."""
    if root is None:
        return None
    if root == DEFAULT_SHM_ROOT and not root.is_dir():  # the default, on a system without it: not an error
        _LOGGER.info("shared memory is off: there is no %s here", root)
        return None
    try:
        return SharedMemory(root, max_bytes)
    except OSError as e:
        _LOGGER.warning("shared memory is off: cannot make a folder in %s (%s)", root, e.strerror or e)
        return None


def checkpoint_dirs(store: Store, formats: Sequence[SaveFormat], *, recover: bool = True) -> CheckpointDirs | None:
    """Training checkpoint dirs' state files and retention, recovered now (if `recover`); None without the format."""
    if not any(SaveKind.TRAINING_CHECKPOINT in f.kinds for f in formats):
        return None
    dirs = CheckpointDirs(store)
    if not recover:
        return dirs
    deleted = dirs.recover()  # a daemon killed between a commit and its state file, or mid-sweep
    if deleted:
        _LOGGER.info("recovered training checkpoint dirs: %d checkpoints past their max_to_keep deleted", deleted)
    return dirs


def write_port(path: Path | None, port: int) -> None:
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)  # readers never see a half-written file
