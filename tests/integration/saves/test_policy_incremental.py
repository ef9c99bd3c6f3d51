"""Incremental policy saves (`save`, `save_checkpoint`): unchanged variables copied from the run's newest save.

A QPolicy whose middle layer (600 x 600 float32, 1.4 MB) stays frozen while
its output layer trains. Two savers save the same values at each step, one
incremental (the default) and one with `incremental=False`: the incremental
save's variables/ must be byte-identical to the full one's, whatever travelled,
over gRPC and through shared memory, and the SavedModel must load with the
saved values.
"""

from __future__ import annotations

import filecmp
from collections.abc import Iterator

import numpy as np
import pytest
import tensorflow as tf

from checkpointd_client import RemotePolicySaver
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, start_daemon

LIMIT = 60.0
FILES = ("variables/variables.index", "variables/variables.data-00000-of-00001")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The copying path always: these tests are about its copies (the per-save choice: test_incremental_paths.py)."""
    base = tmp_path_factory.mktemp("daemon")
    proc = start_daemon(base / "root", base / "work", "--incremental-path", "copy")
    try:
        yield proc
    finally:
        proc.terminate()


@pytest.fixture(scope="module")
def policy() -> object:
    return policies.build(policies.q(hidden=(600, 600)))


class Pair:
    """The same policy saved by an incremental saver and by one with incremental off, on two runs."""

    def __init__(self, daemon: Daemon, policy: object, name: str, shared_memory: bool) -> None:
        self.daemon, self.policy, self.shared_memory = daemon, policy, shared_memory
        self.step = tf.Variable(0, dtype=tf.int64)
        self.runs = (f"{name}-incr", f"{name}-full")
        self.savers = [
            RemotePolicySaver(
                policy,
                daemon.address,
                run=run,
                train_step=self.step,
                timeout=LIMIT,
                shared_memory=shared_memory,
                incremental=incremental,
            )  # fmt: skip
            for run, incremental in zip(self.runs, (True, False), strict=True)
        ]

    def save(self, export_dir: str, checkpoint: bool = False) -> list[object]:
        results = []
        for saver in self.savers:
            save = saver.save_checkpoint if checkpoint else saver.save
            results.append(save(export_dir, blocking=True).result(LIMIT))
        return results

    def same(self, export_dir: str) -> bool:
        incr, full = (self.daemon.root / run / export_dir for run in self.runs)
        return all(filecmp.cmp(incr / f, full / f, shallow=False) for f in FILES)

    def close(self) -> None:
        for saver in self.savers:
            saver.close()


@pytest.fixture(params=[False, True], ids=["grpc", "shm"])
def pair(daemon: Daemon, policy: object, request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(daemon, policy, f"policy-{request.param_index}", shared_memory=request.param)
    try:
        yield p
    finally:
        p.close()


def _train_output_layer(policy: object, by: float) -> None:
    last = policy.variables()[-1]  # type: ignore[attr-defined]  # the output layer's bias
    last.assign_add(tf.fill(last.shape, by))


def test_policy_saves_copy_the_unchanged_variables_and_are_byte_identical_to_full_ones(
    pair: Pair, policy: object, daemon: Daemon
) -> None:
    frozen = max(v.shape.num_elements() * 4 for v in policy.variables())  # type: ignore[attr-defined]
    pair.step.assign(1)
    first, _ = pair.save("p/1")
    assert first.bytes_copied == 0  # type: ignore[attr-defined]
    _train_output_layer(policy, 0.5)
    pair.step.assign(2)
    incr, full = pair.save("p/2")
    assert pair.same("p/2")
    assert incr.bytes_copied >= frozen and full.bytes_copied == 0  # type: ignore[attr-defined]
    loaded = tf.saved_model.load(str(daemon.root / pair.runs[0] / "p/2"))
    saved = {v.name: v.numpy() for v in loaded.model_variables}
    for v in policy.variables():  # type: ignore[attr-defined]
        np.testing.assert_array_equal(saved[v.name], v.numpy())
    # save_checkpoint: its own layout (checkpoint keys), its own base.
    pair.step.assign(3)
    pair.save("c/1", checkpoint=True)
    _train_output_layer(policy, 1.0)
    pair.step.assign(4)
    incr, _ = pair.save("c/2", checkpoint=True)
    assert pair.same("c/2") and incr.bytes_copied >= frozen  # type: ignore[attr-defined]
    transports = {
        line.rpartition("transport=")[2] for line in daemon.log().splitlines() if f"saved run={pair.runs[0]} " in line
    }
    assert transports == {"shm" if pair.shared_memory else "grpc"}


def test_a_save_under_one_chunk_is_sent_whole_with_no_base(daemon: Daemon) -> None:
    small = policies.build(policies.q(hidden=(8,)))  # a few hundred bytes of variables: under one 1 MiB chunk
    p = Pair(daemon, small, "policy-small", shared_memory=False)
    try:
        p.step.assign(1)
        p.save("p/1")
        small.variables()[-1].assign_add(tf.fill(small.variables()[-1].shape, 0.5))  # type: ignore[attr-defined]
        p.step.assign(2)
        incr, full = p.save("p/2")
        assert p.same("p/2")
        assert incr.bytes_copied == 0 and incr.bytes_received == full.bytes_received  # type: ignore[attr-defined]
    finally:
        p.close()
