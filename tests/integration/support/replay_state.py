"""A replay buffer, a variable and a step for byte-for-byte checkpoint tests, and a checkpoint's files.

`ReplayState` is what a DQN job's checkpoint holds, cut to what a delta or
incremental save has to get right: a real `TFUniformReplayBuffer` (rows of
`width` floats and an int), a weight variable that a "train" rewrites
whole, and the step. `committed_files` reads a checkpoint prefix's two
files, to compare a committed save with `tf.train.Checkpoint.write`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
from hypothesis import strategies as st
from tf_agents.replay_buffers import tf_uniform_replay_buffer


class ReplayState:
    """A replay buffer of `width`-float rows, a `weights_shape` variable and a step."""

    def __init__(
        self,
        batch_size: int,
        max_length: int,
        *,
        width: int = 5,
        weights_shape: tuple[int, ...] = (4, 3),
        seed: int = 0,
    ) -> None:
        self.rng = np.random.default_rng(seed)
        self.batch_size, self.width, self.weights_shape = batch_size, width, weights_shape
        spec = (tf.TensorSpec([width], tf.float32, "observation"), tf.TensorSpec([], tf.int32, "action"))
        self.buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(spec, batch_size, max_length=max_length)
        self.weights = tf.Variable(self.rng.standard_normal(weights_shape).astype(np.float32))
        self.step = tf.Variable(0, dtype=tf.int64)

    def objects(self) -> dict[str, Any]:
        return {"replay_buffer": self.buffer, "weights": self.weights, "global_step": self.step}

    def add(self, batches: int) -> None:
        for _ in range(batches):
            self.buffer.add_batch(
                (
                    tf.constant(self.rng.standard_normal((self.batch_size, self.width)).astype(np.float32)),
                    tf.constant(self.rng.integers(0, 1000, self.batch_size).astype(np.int32)),
                )
            )

    def train(self) -> None:
        self.weights.assign(self.rng.standard_normal(self.weights_shape).astype(np.float32))


def ops(max_add: int, max_size: int) -> st.SearchStrategy[list[tuple[str, int]]]:
    """Random steps of a trainer between saves: add batches, clear (zeroing or not), train, save."""
    return st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(0, max_add)),
            st.tuples(st.just("clear"), st.booleans()),
            st.tuples(st.just("train"), st.just(0)),
            st.tuples(st.just("save"), st.just(0)),
        ),
        max_size=max_size,
    )


def run_ops(state: ReplayState, steps: list[tuple[str, int]], save: Callable[[], None]) -> None:
    """Applies `steps` (from `ops`) to `state`, with a save first and last; `save` for each save."""
    for op, arg in [("save", 0), *steps, ("save", 0)]:
        if op == "add":
            state.add(arg)
        elif op == "clear":
            state.buffer._clear(clear_all_variables=bool(arg))  # noqa: SLF001 - clear() never zeroes
        elif op == "train":
            state.train()
        else:
            save()


def committed_files(prefix: Path) -> dict[str, bytes]:
    """A checkpoint prefix's index and data file, by suffix."""
    return {s: prefix.with_name(prefix.name + s).read_bytes() for s in (".index", ".data-00000-of-00001")}
