"""What is on disk after saves: files, the daemon's own entries, listings, a save's step."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import tensorflow as tf

TRAIN_STEP_KEY = "train_step/.ATTRIBUTES/VARIABLE_VALUE"  # same key in both layouts
# PolicySaver.save_checkpoint's files, and the variables/ part of PolicySaver.save's.
CHECKPOINT_FILES = {"variables/variables.index", "variables/variables.data-00000-of-00001"}


def files_under(root: Path) -> set[str]:
    """Every file under `root`, as paths relative to it."""
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


def checkpointd_entries(root: Path) -> list[str]:
    """Temp and replaced trees the daemon makes (`.checkpointd-*`) anywhere under `root`."""
    return [
        os.path.join(d, name) for d, dirs, fs in os.walk(root) for name in dirs + fs if name.startswith(".checkpointd-")
    ]


def listing(*roots: Path) -> dict[str, str]:
    """Every entry under `roots`, symlinks not followed: path -> type (and size for files)."""
    found = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = Path(dirpath, name)
                st = path.lstat()
                size = st.st_size if stat.S_ISREG(st.st_mode) else ""
                found[str(path)] = f"{stat.filemode(st.st_mode)[0]}{size}"
    return found


def saved_step(export_dir: Path) -> int:
    """The train step stored in a save's variables (same key in both layouts)."""
    reader = tf.train.load_checkpoint(str(export_dir / "variables" / "variables"))
    return int(reader.get_tensor(TRAIN_STEP_KEY))


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[str]:
    """Makes the existing dir `path` unwritable even for root; yields the OS's words for it.

    A read-only tmpfs mounted over it (hiding what it holds until the context
    ends), else the immutable attribute (which stops new entries in `path`
    itself only); skips, saying why, where neither is allowed: permission
    bits do not stop root.
    """
    tried = []
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode == 0:
        try:
            yield "Read-only file system"
        finally:
            subprocess.run(["umount", str(path)], check=False)
        return
    tried.append(f"mount: {done.stderr.strip()}")
    done = (
        subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True) if shutil.which("chattr") else None
    )
    if done is not None and done.returncode == 0:
        try:
            yield "Operation not permitted"
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=False)
        return
    tried.append(f"chattr: {done.stderr.strip() if done else 'not installed'}")
    pytest.skip("cannot make a directory read-only for root here: " + "; ".join(tried))
