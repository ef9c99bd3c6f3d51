"""Resource limits against the real daemon: past them RESOURCE_EXHAUSTED, never an OOM.

`--max-concurrent-uploads` caps saves admitted at once over all runs;
`--max-staging-bytes` caps snapshot bytes held in memory. A refused request
is refused before its lane decides: nothing is written, nothing counted, and
the next save after the held one ends is admitted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest
import tensorflow as tf

from checkpointd_client import LimitExceededError, RemotePolicySaver
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon
from tests.integration.support.raw import TIMEOUT, HeldSave, code_of, counts


@pytest.fixture(scope="module")
def policy() -> object:
    return policies.build(policies.q())


@pytest.fixture
def savers(policy: object) -> Iterator[Callable[[Daemon, str], tuple[RemotePolicySaver, tf.Variable]]]:
    made: list[RemotePolicySaver] = []

    def make(daemon: Daemon, run: str) -> tuple[RemotePolicySaver, tf.Variable]:
        step = tf.Variable(1, dtype=tf.int64)
        saver = RemotePolicySaver(policy, daemon.address, run=run, train_step=step, timeout=TIMEOUT)
        made.append(saver)
        return saver, step

    yield make
    for saver in made:
        saver.close(timeout=TIMEOUT)


def test_saves_past_max_concurrent_uploads_are_refused_until_one_ends(
    fresh_daemon: Callable[..., Daemon], savers
) -> None:
    daemon = fresh_daemon("--max-concurrent-uploads", "1")
    first, first_step = savers(daemon, "first")
    second, _ = savers(daemon, "second")
    second.register()
    held = HeldSave(daemon, first, first_step, "held")
    try:
        # Another run's lane is idle, but the daemon's one upload slot is taken.
        with pytest.raises(LimitExceededError, match="--max-concurrent-uploads"):
            second.save("refused").result(TIMEOUT)  # a non-blocking save: its ticket fails
        assert not (daemon.root / "second" / "refused").exists()
        assert counts(daemon, "second") == (0, 0, 0)
        assert held.release().path.endswith("held")
    finally:
        held.close()
    assert second.save("admitted", blocking=True).result(TIMEOUT).path.endswith("admitted")
    assert counts(daemon, "second") == (1, 0, 0)


def test_a_snapshot_past_the_staging_memory_left_is_refused(
    fresh_daemon: Callable[..., Daemon], savers, policy: object
) -> None:
    snapshot_bytes = sum(v.numpy().nbytes for v in policy.variables()) + 8  # + train_step
    # Room for one snapshot, not two.
    daemon = fresh_daemon("--max-staging-bytes", str(snapshot_bytes + snapshot_bytes // 2))
    first, first_step = savers(daemon, "first")
    second, second_step = savers(daemon, "second")
    held = HeldSave(daemon, first, first_step, "held")
    try:
        raw = HeldSave(daemon, second, second_step, "refused", expect_accept=False)
        try:
            assert code_of(raw) == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            raw.close()
        with pytest.raises(LimitExceededError, match="--max-staging-bytes"):
            second.save_checkpoint("refused").result(TIMEOUT)
        assert counts(daemon, "second") == (0, 0, 0)
        held.release()
    finally:
        held.close()
    assert second.save_checkpoint("admitted", blocking=True).result(TIMEOUT) is not None
    assert (daemon.root / "second" / "admitted" / "variables" / "variables.index").exists()
