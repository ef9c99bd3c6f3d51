"""A whole TF-Agents training state through the daemon, bit for bit.

DQN with Adam (slots trained), a TFUniformReplayBuffer with collected data,
the global step, a TF metric and a py metric (NumpyState), as
`training_state.build` makes them. Saved with RemoteCheckpointer, restored
into objects built from another seed: every value TensorFlow's saver reads
equals the value at the save call; the files equal those of an in-process
`common.Checkpointer.save`; and TensorFlow's own readers read the daemon's
dir.
"""

from __future__ import annotations

import filecmp
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tf_agents.utils import common

from checkpointd_client import RemoteCheckpointer, SaveTicket
from tests.integration.support import training_state
from tests.integration.support.daemon import Daemon

LIMIT = 60.0


@dataclass
class Saved:
    ticket: SaveTicket
    expected: dict[str, bytes]  # what the checkpoint must hold: the state at the call
    local_dir: Path  # an in-process Checkpointer's save of the same state
    run: str


@pytest.fixture(scope="module")
def saved(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    state = training_state.build(seed=0)
    state.collect(80)
    state.train(5)
    run = "fidelity"
    with RemoteCheckpointer("train", daemon.address, run=run, max_to_keep=3, timeout=LIMIT, **state.objects) as ckpt:
        ticket = ckpt.save(state.global_step)  # non-blocking: the values are those of the call
        expected = training_state.values(state.objects)
        local_dir = tmp_path_factory.mktemp("local") / "train"
        common.Checkpointer(str(local_dir), max_to_keep=3, **state.objects).save(state.global_step)
        # Changed right after the call, before the upload is known to be done.
        state.collect(6)
        state.train(3)
        assert training_state.values(state.objects) != expected
        ticket.result(LIMIT)
    yield Saved(ticket, expected, local_dir, run)


def test_every_value_restored_is_bit_identical_to_the_state_at_the_save_call(daemon: Daemon, saved: Saved) -> None:
    fresh = training_state.build(seed=1)
    fresh.create_optimizer_variables()  # as Learner does before restoring
    assert training_state.values(fresh.objects) != saved.expected
    with RemoteCheckpointer("train", daemon.address, run=saved.run, timeout=LIMIT, **fresh.objects) as ckpt:
        assert ckpt.checkpoint_exists
        ckpt.initialize_or_restore()
    restored = training_state.values(fresh.objects)
    assert set(restored) == set(saved.expected)
    assert [k for k in saved.expected if restored[k] != saved.expected[k]] == []
    # The pieces the issue names, read through the objects themselves.
    assert fresh.global_step.numpy() == saved.ticket.step == 5
    assert fresh.replay_buffer.num_frames().numpy() == 80
    slots = [v for v in fresh.agent._optimizer.variables if v.shape.rank]  # noqa: SLF001 - Adam's m and v
    assert len(slots) == 8 and all(np.any(v.numpy() != 0) for v in slots)
    assert fresh.py_metric._buffer._len > 0  # noqa: SLF001 - the py metric's NumpyState came back


def test_slots_an_optimizer_builds_after_the_restore_get_the_saved_values(daemon: Daemon, saved: Saved) -> None:
    fresh = training_state.build(seed=2)  # no slots yet, as in the tutorial's restarted process
    with RemoteCheckpointer("train", daemon.address, run=saved.run, timeout=LIMIT, **fresh.objects) as ckpt:
        ckpt.initialize_or_restore()
        fresh.create_optimizer_variables()  # TensorFlow restores deferred slots as they are made
    restored = training_state.values(fresh.objects)
    assert [k for k in saved.expected if restored.get(k) != saved.expected[k]] == []


def test_the_files_are_byte_identical_to_an_in_process_checkpointer_save(daemon: Daemon, saved: Saved) -> None:
    ours = daemon.root / saved.run / "train"
    for suffix in (".index", ".data-00000-of-00001"):
        name = f"ckpt-{saved.ticket.step}{suffix}"
        assert filecmp.cmp(ours / name, saved.local_dir / name, shallow=False), name


def test_tensorflow_and_an_in_process_checkpointer_read_the_daemons_dir(daemon: Daemon, saved: Saved) -> None:
    directory = str(daemon.root / saved.run / "train")
    assert tf.train.latest_checkpoint(directory) == str(Path(directory) / f"ckpt-{saved.ticket.step}")
    fresh = training_state.build(seed=3)
    fresh.create_optimizer_variables()
    in_process = common.Checkpointer(directory, max_to_keep=3, **fresh.objects)
    assert in_process.checkpoint_exists
    in_process.initialize_or_restore()
    restored = training_state.values(fresh.objects)
    assert [k for k in saved.expected if restored[k] != saved.expected[k]] == []
