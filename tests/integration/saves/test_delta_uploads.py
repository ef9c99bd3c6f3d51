"""Delta snapshots over gRPC: chunks nobody wrote go as the base's unsummed, and each checkpoint is the state at its call.

A RemoteCheckpointer over gRPC copies each save into the buffers of its
previous upload, and only what changed since (`checkpointd_client.delta`);
when the daemon's base is the save those buffers held, the chunks no copy
wrote are sent as SameChunks with the base's digests, without summing them
(`checkpointd.protocol.increments`). A real TFUniformReplayBuffer with rows
of 32 KiB (a 1 MiB chunk is 32 rows) and a variable change between saves;
after each save the committed checkpoint must be byte for byte what
`tf.train.Checkpoint.write` makes of the same objects right after the call.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointd_client import RemoteCheckpointer
from tests.integration.support.daemon import Daemon, start_daemon
from tests.integration.support.replay_state import ReplayState, committed_files, ops, run_ops

LIMIT = 60.0
_RUNS = itertools.count()
WIDTH = 8192  # float32: 32 KiB a row


def State(batch_size: int, max_length: int, seed: int = 0) -> ReplayState:  # noqa: N802 - made as a class is
    """A replay buffer of wide rows (a 1 MiB chunk is 32 of them), a 64 x 64 variable and a step."""
    return ReplayState(batch_size, max_length, width=WIDTH, weights_shape=(64, 64), seed=seed)


def _save_and_compare(ckpt: RemoteCheckpointer, state: State, scratch: Path, step: int | None = None) -> Any:
    """Saves the next step (or `step`) and checks the daemon's files are what TensorFlow writes of the objects now."""
    state.step.assign(step if step is not None else int(state.step.numpy()) + 1)
    step = int(state.step.numpy())
    result = ckpt.save(state.step, blocking=True).result(LIMIT)
    assert result is not None
    expected = scratch / f"expected-{step}"
    ckpt.checkpoint.write(str(expected))  # the same root: the save_counter the save wrote
    assert committed_files(Path(result.path)) == committed_files(
        expected
    ), f"step {step}: the committed checkpoint is not the state"
    return result


def _unsummed(ckpt: RemoteCheckpointer) -> int:
    sent = ckpt._saves.last_sent  # noqa: SLF001 - what the last incremental upload sent
    return sent.unsummed_bytes if sent is not None else 0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The copying path always, so every save after the first is offered its base."""
    base = tmp_path_factory.mktemp("daemon")
    proc = start_daemon(base / "root", base / "work", "--incremental-path", "copy")
    try:
        yield proc
    finally:
        proc.terminate()


@pytest.fixture
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="delta-uploads-") as d:
        yield Path(d)


def _checkpointer(daemon: Daemon, state: State, run: str) -> RemoteCheckpointer:
    return RemoteCheckpointer(
        "train", daemon.address, run=run, timeout=LIMIT, max_to_keep=2, shared_memory=False, **state.objects()
    )


_OPS = ops(max_add=70, max_size=10)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch_size=st.integers(1, 2), max_length=st.integers(40, 100), steps=_OPS)
def test_every_committed_checkpoint_is_the_state_at_its_call(
    daemon: Daemon, scratch: Path, batch_size: int, max_length: int, steps: list[tuple[str, int]]
) -> None:
    state = State(batch_size, max_length)
    with _checkpointer(daemon, state, f"uploads-{next(_RUNS)}") as ckpt:
        run_ops(state, steps, lambda: _save_and_compare(ckpt, state, scratch))


def test_the_chunks_nobody_wrote_since_the_base_are_not_summed(daemon: Daemon, scratch: Path) -> None:
    state = State(batch_size=1, max_length=320)  # 10 MiB of observations: ten chunks
    state.add(320)
    with _checkpointer(daemon, state, "uploads-unsummed") as ckpt:
        _save_and_compare(ckpt, state, scratch)
        _save_and_compare(ckpt, state, scratch)  # the first upload's buffers come back holding its snapshot
        state.add(5)  # rows 0..4: the first chunk of each column
        state.train()
        result = _save_and_compare(ckpt, state, scratch)
        assert result.bytes_copied >= 9 * (1 << 20)
        assert _unsummed(ckpt) >= 9 * (1 << 20), "the nine chunks of observations nobody wrote were summed"


def test_a_base_that_is_not_the_buffers_save_is_summed_whole(daemon: Daemon, scratch: Path) -> None:
    state = State(batch_size=1, max_length=320)
    state.add(320)
    run = "uploads-other-base"
    with _checkpointer(daemon, state, run) as ckpt, _checkpointer(daemon, state, run) as other:
        _save_and_compare(ckpt, state, scratch)
        _save_and_compare(ckpt, state, scratch)
        # Another checkpointer of the run commits the dir's newest save: the base ckpt's next save is offered.
        state.add(3)
        _save_and_compare(other, state, scratch)
        state.add(3)  # rows the first checkpointer's buffers do not hold, as the base does not
        state.train()
        result = _save_and_compare(ckpt, state, scratch)
        assert result.bytes_copied > 0  # it had a base, and compared against it
        assert _unsummed(ckpt) == 0, "chunks were taken as a base's that is not the save the buffers hold"
