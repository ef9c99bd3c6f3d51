"""Delta snapshots against a real daemon: each checkpoint is the state at its call, byte for byte.

A same-host RemoteCheckpointer copies into the run's shared-memory segment
only what changed since the segment's last snapshot
(`checkpointd_client.delta`). Here a real TFUniformReplayBuffer (random
batch sizes and lengths, wrap-arounds, clears with and without zeroing,
clears inside a tf.function) and a variable change between saves; after
each save the checkpoint the daemon committed must be byte for byte the
files `tf.train.Checkpoint.write` makes of the same objects right after
the call (nothing changes them in between), and the checkpointer's
`snapshot_copy` says how much was copied and why.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointd_client import RemoteCheckpointer, tf_checkpoint
from tests.integration.support.daemon import Daemon
from tests.integration.support.replay_state import ReplayState as State
from tests.integration.support.replay_state import committed_files, ops, run_ops

LIMIT = 60.0
_RUNS = itertools.count()


def _save_and_compare(daemon: Daemon, ckpt: RemoteCheckpointer, state: State, scratch: Path) -> None:
    """Saves the next step and checks the daemon's files are what TensorFlow writes of the objects now."""
    state.step.assign_add(1)
    step = int(state.step.numpy())
    result = ckpt.save(state.step, blocking=True).result(LIMIT)
    assert result is not None
    expected = scratch / f"expected-{step}"
    ckpt.checkpoint.write(str(expected))  # the same root: the save_counter the save wrote
    committed = Path(result.path)
    assert committed_files(committed) == committed_files(
        expected
    ), f"step {step}: the committed checkpoint is not the state at its call"


@pytest.fixture
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="delta-") as d:
        yield Path(d)


_OPS = ops(max_add=14, max_size=14)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch_size=st.integers(1, 3), max_length=st.integers(1, 7), steps=_OPS)
def test_every_committed_checkpoint_is_the_state_at_its_call(
    daemon: Daemon, scratch: Path, batch_size: int, max_length: int, steps: list[tuple[str, int]]
) -> None:
    state = State(batch_size, max_length)
    run = f"delta-{next(_RUNS)}"
    with RemoteCheckpointer("train", daemon.address, run=run, timeout=LIMIT, max_to_keep=2, **state.objects()) as ckpt:

        def save() -> None:
            _save_and_compare(daemon, ckpt, state, scratch)
            copy = ckpt.snapshot_copy
            assert copy is not None and copy.bytes_copied <= copy.nbytes

        run_ops(state, steps, save)


def _storage_bytes(state: State) -> tuple[int, int]:
    """(every storage variable's bytes, one row's bytes across them)."""
    variables = state.buffer._data_table.variables() + state.buffer._id_table.variables()  # noqa: SLF001
    total = sum(v.numpy().nbytes for v in variables)
    return total, total // int(variables[0].shape[0])


def test_a_save_copies_the_rows_written_since_and_every_other_tensor(daemon: Daemon, scratch: Path) -> None:
    state = State(batch_size=2, max_length=50)
    state.add(10)
    with RemoteCheckpointer("train", daemon.address, run="delta-rows", timeout=LIMIT, **state.objects()) as ckpt:
        _save_and_compare(daemon, ckpt, state, scratch)
        first = ckpt.snapshot_copy
        assert first is not None and first.bytes_copied == first.nbytes
        assert first.whole == "the first copy into this segment"

        state.add(3)  # ids 10..12: three rows in each of the two blocks
        state.train()
        _save_and_compare(daemon, ckpt, state, scratch)
        storage, row = _storage_bytes(state)
        second = ckpt.snapshot_copy
        assert second is not None and second.whole is None
        assert second.bytes_copied == second.nbytes - storage + 2 * 3 * row

        _save_and_compare(daemon, ckpt, state, scratch)  # nothing added: the buffer is not copied at all
        assert ckpt.snapshot_copy is not None and ckpt.snapshot_copy.bytes_copied == second.nbytes - storage


def test_a_clear_inside_a_tf_function_is_seen_though_the_cursor_comes_back(daemon: Daemon, scratch: Path) -> None:
    """An on-policy loop: clear, then refill to the same cursor, so only the clear count tells."""
    state = State(batch_size=2, max_length=20)
    with RemoteCheckpointer("train", daemon.address, run="delta-clear", timeout=LIMIT, **state.objects()) as ckpt:
        observations = tf.constant(np.arange(10, dtype=np.float32).reshape(2, 5))

        @tf.function  # traced after the checkpointer was built, as a training loop is
        def collect(offset: tf.Tensor) -> None:
            state.buffer.clear()
            for _ in tf.range(6):
                state.buffer.add_batch((observations + offset, tf.zeros([2], tf.int32)))

        collect(tf.constant(0.0))
        _save_and_compare(daemon, ckpt, state, scratch)
        collect(tf.constant(1.0))  # every row rewritten; the cursor is where it was
        _save_and_compare(daemon, ckpt, state, scratch)
        copy = ckpt.snapshot_copy
        assert copy is not None and copy.whole == "a replay buffer was cleared" and copy.bytes_copied == copy.nbytes


def test_a_copy_that_failed_part_way_makes_the_next_one_whole(
    daemon: Daemon, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = State(batch_size=1, max_length=30)
    state.add(5)
    with RemoteCheckpointer("train", daemon.address, run="delta-torn", timeout=LIMIT, **state.objects()) as ckpt:
        _save_and_compare(daemon, ckpt, state, scratch)
        state.add(2)
        state.train()
        real = tf_checkpoint.copy_all

        def torn(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
            real(pairs[: len(pairs) // 2])  # half the segment written, then a failure
            raise MemoryError("copy interrupted")

        monkeypatch.setattr(tf_checkpoint, "copy_all", torn)
        with pytest.raises(MemoryError):
            ckpt.save(100, blocking=True)
        monkeypatch.setattr(tf_checkpoint, "copy_all", real)
        state.add(1)
        _save_and_compare(daemon, ckpt, state, scratch)
        copy = ckpt.snapshot_copy
        assert copy is not None and copy.whole == "the previous copy into the segment did not complete"
        assert copy.bytes_copied == copy.nbytes


def test_a_new_tensor_changes_the_layout_and_the_copy_is_whole(daemon: Daemon, scratch: Path) -> None:
    state = State(batch_size=1, max_length=30)
    extra = tf.Module()
    with RemoteCheckpointer(
        "train", daemon.address, run="delta-layout", timeout=LIMIT, extra=extra, **state.objects()
    ) as ckpt:
        state.add(4)
        _save_and_compare(daemon, ckpt, state, scratch)
        extra.slot = tf.Variable(np.ones(3, np.float32))  # an optimizer building its slots, say
        state.add(1)
        _save_and_compare(daemon, ckpt, state, scratch)
        copy = ckpt.snapshot_copy
        assert copy is not None and copy.whole is not None and copy.bytes_copied == copy.nbytes
        state.add(1)
        _save_and_compare(daemon, ckpt, state, scratch)
        assert ckpt.snapshot_copy is not None and ckpt.snapshot_copy.whole is None


def test_a_segment_the_daemon_evicted_and_remade_is_written_whole(
    fresh_daemon: Callable[..., Daemon], scratch: Path, tmp_path: Path
) -> None:
    """Room for one segment: each run's save evicts the other's idle one, and the next offer is a new path."""
    shm_root = tmp_path / "shm"
    shm_root.mkdir()
    a, b = State(batch_size=2, max_length=400, seed=1), State(batch_size=2, max_length=400, seed=2)
    probe = fresh_daemon("--shm-dir", str(shm_root))
    with RemoteCheckpointer("train", probe.address, run="delta-probe", timeout=LIMIT, **a.objects()) as ckpt:
        ckpt.save(0, blocking=True).result(LIMIT)
        (segment,) = (p for p in next(shm_root.glob("checkpointd-*")).iterdir() if p.suffix != ".lock")
        size = segment.stat().st_size
    assert probe.terminate() == 0
    daemon = fresh_daemon("--shm-dir", str(shm_root), "--max-staging-bytes", str(size * 3 // 2))
    with (
        RemoteCheckpointer("train", daemon.address, run="delta-a", timeout=LIMIT, **a.objects()) as first,
        RemoteCheckpointer("train", daemon.address, run="delta-b", timeout=LIMIT, **b.objects()) as second,
    ):
        a.add(5)
        _save_and_compare(daemon, first, a, scratch)
        a.add(3)
        _save_and_compare(daemon, first, a, scratch)  # the same segment: only the rows
        assert first.snapshot_copy is not None and first.snapshot_copy.whole is None
        b.add(2)
        _save_and_compare(daemon, second, b, scratch)  # evicts a's segment
        a.add(3)
        _save_and_compare(daemon, first, a, scratch)
        copy = first.snapshot_copy
        assert copy is not None and copy.whole == "another segment" and copy.bytes_copied == copy.nbytes
