"""The object graph described once: a change after it still gives the checkpoint TensorFlow writes, byte for byte.

A RemoteCheckpointer describes its tf.train.Checkpoint in full at its first
save and afterwards only checks that the description still holds
(`checkpointd_client.described_graph`). Here the graph changes after that
first save in each way a training job's can: optimizer slots created by the
first apply (Keras' optimizer, as children; TF1's, as slot variables), a
variable added, an object replaced, a tracked list grown, and Python state
of another size. After each save, the checkpoint the daemon committed must
be byte for byte the files `tf.train.Checkpoint.write` makes of the same
objects right after the call, and the number of full descriptions says
whether the change was seen (and that an unchanged graph is not described
again).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tf_agents.utils import numpy_storage

from checkpointd_client import RemoteCheckpointer
from tests.integration.support.daemon import Daemon
from tests.integration.support.replay_state import committed_files

LIMIT = 60.0
_RUNS = itertools.count()


def _save_and_compare(ckpt: RemoteCheckpointer, step: tf.Variable, scratch: Path) -> int:
    """Saves the next step, checks the committed files are TensorFlow's own write of the objects now; returns
    the checkpointer's full descriptions so far."""
    step.assign_add(1)
    result = ckpt.save(step, blocking=True).result(LIMIT)
    assert result is not None
    expected = scratch / f"expected-{int(step.numpy())}-{next(_RUNS)}"
    ckpt.checkpoint.write(str(expected))
    assert committed_files(Path(result.path)) == committed_files(
        expected
    ), "the committed checkpoint is not TensorFlow's write"
    return ckpt._saves.described.full_descriptions  # noqa: SLF001 - what the test is about


class _Model(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = tf.keras.layers.Dense(3)
        self.dense.build((None, 4))
        self.items: list[tf.Variable] = [tf.Variable(np.arange(3, dtype=np.float32))]

    def loss(self) -> tf.Tensor:
        return tf.reduce_sum(self.dense(tf.ones((2, 4)))) + tf.reduce_sum(self.items[0])


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    return tmp_path


@pytest.mark.parametrize("optimizer", ["keras", "tf1"])
def test_slots_made_by_the_first_apply_are_in_the_next_save(daemon: Daemon, scratch: Path, optimizer: str) -> None:
    model, step = _Model(), tf.Variable(0, dtype=tf.int64)
    opt: Any = tf.keras.optimizers.Adam(0.1) if optimizer == "keras" else tf.compat.v1.train.AdamOptimizer(0.1)
    variables = [*model.dense.trainable_variables, model.items[0]]

    def train() -> None:
        if optimizer == "keras":
            with tf.GradientTape() as tape:
                loss = model.loss()
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
        else:
            opt.minimize(model.loss, var_list=variables)

    objects = {"model": model, "optimizer": opt, "global_step": step}
    with RemoteCheckpointer("train", daemon.address, run=f"graph-slots-{optimizer}", timeout=LIMIT, **objects) as ckpt:
        first = _save_and_compare(ckpt, step, scratch)  # no slots yet
        assert _save_and_compare(ckpt, step, scratch) == first, "an unchanged graph was described again"
        train()  # creates the slots
        assert _save_and_compare(ckpt, step, scratch) == first + 1, "the slots made by the first apply were not seen"
        train()
        assert _save_and_compare(ckpt, step, scratch) == first + 1


def test_a_variable_added_an_object_replaced_and_a_list_grown_are_each_seen(daemon: Daemon, scratch: Path) -> None:
    model, step = _Model(), tf.Variable(0, dtype=tf.int64)
    with RemoteCheckpointer("train", daemon.address, run="graph-changes", timeout=LIMIT, model=model,
                            global_step=step) as ckpt:  # fmt: skip
        described = _save_and_compare(ckpt, step, scratch)
        model.extra = tf.Variable([1.0, 2.0])
        described += 1
        assert _save_and_compare(ckpt, step, scratch) == described, "a variable added was not seen"
        model.dense = tf.keras.layers.Dense(5)  # replaced: other variables under the same name
        model.dense.build((None, 4))
        described += 1
        assert _save_and_compare(ckpt, step, scratch) == described, "an object replaced was not seen"
        model.items.append(tf.Variable(7, dtype=tf.int32))
        described += 1
        assert _save_and_compare(ckpt, step, scratch) == described, "a tracked list grown was not seen"
        model.items[0].assign([9.0, 8.0, 7.0])  # values only
        assert _save_and_compare(ckpt, step, scratch) == described


def test_python_state_is_serialized_again_at_each_save(daemon: Daemon, scratch: Path) -> None:
    step = tf.Variable(0, dtype=tf.int64)
    numpy_state = numpy_storage.NumpyState()
    numpy_state.rows = np.zeros(3, np.int64)
    with RemoteCheckpointer("train", daemon.address, run="graph-numpy-state", timeout=LIMIT, numpy_state=numpy_state,
                            global_step=step) as ckpt:  # fmt: skip
        described = _save_and_compare(ckpt, step, scratch)
        numpy_state.rows = np.arange(40, dtype=np.int64)  # another size: another layout, the same graph
        assert _save_and_compare(ckpt, step, scratch) == described
        numpy_state.rows = np.arange(40, dtype=np.int64) * 2
        assert _save_and_compare(ckpt, step, scratch) == described


class _Counter(tf.Module):
    """An object that makes its own tensor at each save (as a lookup table does): its key and size may change."""

    def __init__(self) -> None:
        super().__init__()
        self.values = [1, 2]

    def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
        return {"values": tf.constant(self.values, tf.int64)}

    def _restore_from_tensors(self, restored: dict[str, tf.Tensor]) -> None:
        self.values = list(restored["values"].numpy())


def test_an_object_making_its_own_tensors_is_described_at_every_save(daemon: Daemon, scratch: Path) -> None:
    counter, step = _Counter(), tf.Variable(0, dtype=tf.int64)
    with RemoteCheckpointer("train", daemon.address, run="graph-own-tensors", timeout=LIMIT, counter=counter,
                            global_step=step) as ckpt:  # fmt: skip
        described = _save_and_compare(ckpt, step, scratch)
        counter.values = [3, 4, 5]  # another value and shape, the same graph
        assert _save_and_compare(ckpt, step, scratch) == described + 1
        assert _save_and_compare(ckpt, step, scratch) == described + 2
