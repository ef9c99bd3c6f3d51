"""Sections 1 and 2: TF-Agents' in-process savers and TensorFlow's async checkpoint.

Every timing is of the 2nd and later calls: the first one traces functions and
is reported apart. Outputs are deleted after each call so a large run does not
fill the disk.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import tensorflow as tf
from tf_agents.policies import async_policy_saver, policy_saver

from bench.stats import summarize, timed


def fsync_tree(root: Path) -> None:
    """fsyncs every file and directory under `root`, and `root` itself."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def policy_saver_times(saver: policy_saver.PolicySaver, out: Path, reps: int) -> dict[str, Any]:
    """Section 1: PolicySaver.save and save_checkpoint, each call on its own.

    Also `save` followed by an fsync of what it wrote: PolicySaver never
    fsyncs, checkpointd does before it answers, so this is the like-for-like
    time to durable.
    """
    first, _ = timed(lambda: saver.save(str(out / "first")))
    first_ckpt, _ = timed(lambda: saver.save_checkpoint(str(out / "first-ckpt")))
    _rm(out / "first", out / "first-ckpt")
    save, ckpt, save_fsync = [], [], []
    for i in range(reps):
        seconds, _ = timed(lambda: saver.save(str(out / f"save-{i}")))  # noqa: B023 - called at once
        save.append(seconds)
        _rm(out / f"save-{i}")
        seconds, _ = timed(lambda: saver.save_checkpoint(str(out / f"ckpt-{i}")))  # noqa: B023
        ckpt.append(seconds)
        _rm(out / f"ckpt-{i}")

        def save_and_sync() -> None:
            saver.save(str(out / f"sync-{i}"))  # noqa: B023 - called at once
            fsync_tree(out / f"sync-{i}")  # noqa: B023

        seconds, _ = timed(save_and_sync)
        save_fsync.append(seconds)
        _rm(out / f"sync-{i}")
    return {
        "first_save_seconds": first,
        "first_save_checkpoint_seconds": first_ckpt,
        "save": summarize(save),
        "save_checkpoint": summarize(ckpt),
        "save_fsync": summarize(save_fsync),
    }


def async_policy_saver_times(saver: policy_saver.PolicySaver, out: Path, reps: int) -> dict[str, Any]:
    """Section 2: how long AsyncPolicySaver's non-blocking calls block, and until flush.

    Each call is followed by flush(), so none is skipped.
    """
    asaver = async_policy_saver.AsyncPolicySaver(saver)
    try:
        result: dict[str, Any] = {}
        for kind in ("save", "save_checkpoint"):
            blocked, done = [], []
            for i in range(reps):
                target = out / f"async-{kind}-{i}"
                blocked_s, _ = timed(lambda: getattr(asaver, kind)(str(target)))  # noqa: B023
                flush_s, _ = timed(asaver.flush)
                blocked.append(blocked_s)
                done.append(blocked_s + flush_s)
                if not target.exists():
                    raise RuntimeError(f"AsyncPolicySaver wrote nothing to {target}")
                _rm(target)
            result[f"{kind}_blocked"] = summarize(blocked)
            result[f"{kind}_done"] = summarize(done)
        return result
    finally:
        asaver.close()


def tf_checkpoint(saver: policy_saver.PolicySaver) -> tf.train.Checkpoint:
    """The object PolicySaver.save_checkpoint writes, as one reusable Checkpoint."""
    return tf.train.Checkpoint(
        policy=saver.policy,
        model_variables=saver.policy.model_variables,
        train_step=saver._train_step,  # noqa: SLF001 - the same variable save_checkpoint uses
    )


ASYNC = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)


def tf_async_checkpoint_times(checkpoint: tf.train.Checkpoint, out: Path, reps: int) -> dict[str, Any]:
    """Section 2: `Checkpoint.write` with async checkpointing on: blocked, and until sync()."""
    first, _ = timed(lambda: checkpoint.write(str(out / "tf-first" / "ckpt"), options=ASYNC))
    checkpoint.sync()
    _rm(out / "tf-first")
    blocked, done = [], []
    for i in range(reps):
        prefix = out / f"tf-{i}" / "ckpt"
        blocked_s, _ = timed(lambda: checkpoint.write(str(prefix), options=ASYNC))  # noqa: B023
        sync_s, _ = timed(checkpoint.sync)
        blocked.append(blocked_s)
        done.append(blocked_s + sync_s)
        _rm(prefix.parent)
    return {
        "first_write_seconds": first,
        "write_blocked": summarize(blocked),
        "write_done": summarize(done),
    }


def _rm(*paths: Path) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
