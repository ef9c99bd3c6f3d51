"""An in-place restore keeps reading the save it started from, whatever retention does meanwhile.

On the daemon's host a restore reads the committed files where the daemon
keeps them. Values TensorFlow defers (Adam's slots, restored when the
optimizer builds them on its first apply) are read from those files later,
by path. Retention may delete that save first (a newer one past
`max_to_keep`), or a save of the same name may replace it: the deferred
read must still get the values of the save the restore started from, bit
for bit, and the kept files must go once the restore is done with them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from checkpointd_client import RemoteCheckpointer
from checkpointd_client.restore import checkpoints as checkpoint_restore
from checkpointd_client.transport.connection import ConnectionOptions
from checkpointd_client.transport.session import DaemonSession
from tests.integration.support import training_state
from tests.integration.support.daemon import Daemon, wait_until

LIMIT = 120.0
CHILDREN = {"agent", "policy", "replay_buffer", "global_step", "tf_metric", "py_metric", "save_counter"}


RUNS = iter(f"in-place-{n}" for n in range(100))


@pytest.fixture
def session(daemon: Daemon) -> Iterator[DaemonSession]:
    """A session on a run of the test's own."""
    run = next(RUNS)
    s = DaemonSession(daemon.address, run, ConnectionOptions(timeout=LIMIT), owner="checkpointer", upload_threads=1)
    yield s
    s.shutdown()


def _trained(seed: int) -> training_state.State:
    state = training_state.build(seed=seed)
    state.collect(40)
    state.train(2)  # Adam's slots exist and hold values
    return state


def _save(daemon: Daemon, run: str, state: training_state.State, step: int, train: int = 0) -> None:
    """Saves `state` as the run's train/ckpt-`step`, after `train` more steps (the checkpointer
    restores the run's newest save into the objects first, as common.Checkpointer does)."""
    with RemoteCheckpointer(
        "train", daemon.address, run=run, max_to_keep=1, timeout=LIMIT, **state.objects
    ) as ckpt:  # fmt: skip
        if train:
            state.train(train)
        assert ckpt.save(step, blocking=True).result() is not None


def _open_fds_to(path: Path) -> int:
    """How many of this process's descriptors are open on `path` (deleted or not)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target.removesuffix(" (deleted)") == str(path)
    return count


def test_deferred_slots_are_restored_from_an_in_place_save_that_retention_deleted_meanwhile(
    daemon: Daemon, session: DaemonSession
) -> None:
    trained, saved, resumed, restored = _restored_with_slots_deferred(daemon, session)
    data = (daemon.root / session.run / "train" / "ckpt-5.data-00000-of-00001").resolve()
    assert restored.received == 0
    assert restored.copy is not None  # kept for the deferred slots
    try:
        _save(daemon, session.run, trained, 6, train=2)  # max_to_keep=1: retention deletes ckpt-5
        wait_until(lambda: not data.exists(), "retention deleted ckpt-5")
        resumed.create_optimizer_variables()  # TensorFlow now reads the slots from ckpt-5
        restored.status.assert_consumed()
        assert _differing(training_state.values(resumed.objects), saved) == []
    finally:
        restored.copy.close()
    assert _open_fds_to(data) == 0  # the deleted file's space is freed once the restore is done


def test_deferred_slots_come_from_the_save_restored_even_if_another_of_its_name_replaced_it(
    daemon: Daemon, session: DaemonSession
) -> None:
    index = daemon.root / session.run / "train" / "ckpt-5.index"
    trained, saved, resumed, restored = _restored_with_slots_deferred(daemon, session)
    before = index.stat().st_ino
    assert restored.copy is not None
    try:
        _save(daemon, session.run, trained, 5, train=2)  # other values, slots included, under the same name
        assert index.stat().st_ino != before
        assert training_state.values(trained.objects) != saved
        resumed.create_optimizer_variables()
        restored.status.assert_consumed()
        assert _differing(training_state.values(resumed.objects), saved) == []
    finally:
        restored.copy.close()


def test_a_restore_with_nothing_deferred_keeps_no_file_of_the_save_open(daemon: Daemon, session: DaemonSession) -> None:
    trained = _trained(seed=0)
    _save(daemon, session.run, trained, 5)
    resumed = training_state.build(seed=1)
    resumed.create_optimizer_variables()  # every object exists: nothing is deferred
    restored = checkpoint_restore.restore(session, _checkpoint(resumed), CHILDREN, "train/ckpt-5", "")
    assert restored.in_place and restored.copy is None
    directory = (daemon.root / session.run / "train").resolve()
    assert _open_fds_to(directory / "ckpt-5.index") == 0
    assert _open_fds_to(directory / "ckpt-5.data-00000-of-00001") == 0
    assert training_state.values(resumed.objects) == training_state.values(trained.objects)


def _restored_with_slots_deferred(daemon: Daemon, session: DaemonSession) -> tuple[Any, dict[str, bytes], Any, Any]:
    """A trained state saved as train/ckpt-5, and a new one restored from it in place, its Adam slots deferred.

    Returns (trained, its values as saved, resumed, the restore's result).
    """
    trained = _trained(seed=0)
    trained.global_step.assign(5)
    _save(daemon, session.run, trained, 5)
    saved = training_state.values(trained.objects)
    resumed = training_state.build(seed=1)  # Adam has no slots yet: TensorFlow defers them
    restored = checkpoint_restore.restore(session, _checkpoint(resumed), CHILDREN, "train/ckpt-5", "")
    assert restored.in_place
    return trained, saved, resumed, restored


def _differing(got: dict[str, bytes], want: dict[str, bytes]) -> list[str]:
    """The keys whose values differ (or are missing on either side)."""
    return sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))


def _checkpoint(state: training_state.State) -> object:
    import tensorflow as tf

    return tf.train.Checkpoint(**state.objects)
