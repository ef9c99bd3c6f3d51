"""A RemoteCheckpointer's non-blocking saves decided under the run's busy lock, against the real daemon.

After one save accepted into shared memory, a training checkpoint's next
non-blocking saves of the same layout take the run's busy lock themselves
and copy into the segment with no round trip on the trainer's thread
(`checkpointd_client.local_decision`, as a RemotePolicySaver's do). Each
committed checkpoint must still be, byte for byte, what
`tf.train.Checkpoint.write` makes of the objects at the call; a layout
change goes the ordinary way once; a lock held elsewhere skips exactly, and
the daemon counts that skip.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorflow as tf
from tf_agents.replay_buffers import tf_uniform_replay_buffer

from checkpointd_client import RemoteCheckpointer
from tests.integration.saves.test_held import _HOLDER
from tests.integration.support.daemon import Daemon
from tests.integration.support.raw import TIMEOUT, counts
from tests.integration.support.replay_state import committed_files

_RUNS = itertools.count()


def _held_saves(daemon: Daemon, run: str) -> int:
    """Saves of the job `run`'s training dir the daemon logged as decided by the trainer."""
    return sum(1 for line in daemon.log().splitlines() if f"saved run={run}.train " in line and " held=yes " in line)


class _Trainer:
    """Weights, a replay buffer and a list that can grow: every change a save may see."""

    def __init__(self) -> None:
        self.step = tf.Variable(0, dtype=tf.int64)
        self.model = tf.Module()
        self.model.weights = [tf.Variable(np.full((64, 32), 0.5, np.float32)), tf.Variable(np.zeros(32, np.float32))]
        spec = (tf.TensorSpec([16], tf.float32), tf.TensorSpec([], tf.int32))
        self.buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(spec, batch_size=2, max_length=50)

    def train(self) -> None:
        self.step.assign_add(1)
        n = int(self.step.numpy())
        for w in self.model.weights:
            w.assign_add(tf.ones_like(w) * n)
        self.buffer.add_batch((tf.fill([2, 16], float(n)), tf.fill([2], n)))

    def checkpointer(self, daemon: Daemon, run: str) -> RemoteCheckpointer:
        return RemoteCheckpointer(
            "train", daemon.address, run=run, timeout=TIMEOUT, save_on_notice=False,
            model=self.model, buffer=self.buffer, global_step=self.step,
        )  # fmt: skip


def test_saves_after_the_first_are_decided_under_the_busy_lock_and_each_is_tensorflows_write(
    fresh_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = fresh_daemon("--shm-dir", str(tmp_path))
    trainer, run = _Trainer(), "held-training"
    ckpt = trainer.checkpointer(daemon, run)
    try:
        trainer.train()
        assert ckpt.save(trainer.step, blocking=True).result(TIMEOUT) is not None  # offers the busy lock
        held = _held_saves(daemon, run)
        for i in range(6):
            trainer.train()
            if i == 3:  # another layout: a variable more; that save asks the daemon, the next is held again
                trainer.model.weights.append(tf.Variable(np.arange(8, dtype=np.float32)))
            ticket = ckpt.save(trainer.step)
            assert not ticket.skipped, ticket.reason
            result = ticket.result(TIMEOUT)
            assert result is not None
            expected = tmp_path / f"expected-{i}-{next(_RUNS)}"
            ckpt.checkpoint.write(str(expected))
            assert committed_files(Path(result.path)) == committed_files(
                expected
            ), f"save {i} is not TensorFlow's write"
            assert _held_saves(daemon, run) == held + (i if i >= 3 else i + 1), "held only while the layout holds"
        ckpt.flush(TIMEOUT)
        assert counts(daemon, f"{run}.train") == (7, 0, 0)
    finally:
        ckpt.close(TIMEOUT)


def test_a_busy_lock_held_elsewhere_skips_exactly_and_the_daemon_counts_it(
    fresh_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    shm = tmp_path
    daemon = fresh_daemon("--shm-dir", str(shm))
    trainer, run = _Trainer(), "held-elsewhere"
    ckpt = trainer.checkpointer(daemon, run)
    try:
        trainer.train()
        assert ckpt.save(trainer.step, blocking=True).result(TIMEOUT) is not None
        (lock_file,) = shm.glob(f"checkpointd-*/{run}.train-*.lock")
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock_file)], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            trainer.train()
            counter = int(ckpt.checkpoint.save_counter.numpy())
            skipped = ckpt.save(trainer.step)
            assert skipped.skipped and "busy lock" in skipped.reason
            assert int(ckpt.checkpoint.save_counter.numpy()) == counter  # nothing was saved
        finally:
            holder.kill()
            holder.wait(TIMEOUT)
        trainer.train()
        after = ckpt.save(trainer.step)
        assert not after.skipped and after.result(TIMEOUT) is not None
        ckpt.flush(TIMEOUT)  # reports the skip decided here
        assert counts(daemon, f"{run}.train") == (2, 1, 0)
        assert _held_saves(daemon, run) == 1
    finally:
        ckpt.close(TIMEOUT)
