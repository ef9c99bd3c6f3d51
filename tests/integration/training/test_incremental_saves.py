"""Incremental training checkpoints over gRPC: only changed chunks travel, and every checkpoint is a full one.

A DQN training state (`training_state.build`) plus an 8 MiB "replay buffer"
variable whose rows are rewritten between saves, as a TFUniformReplayBuffer
overwrites a run of them. Each checkpoint the daemon commits must equal,
byte for byte, the one an in-process `common.Checkpointer.save` writes for
the same values (the same Checkpointer saves after each remote save, so the
save counters agree), whatever its base went through.
"""

from __future__ import annotations

import filecmp
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tf_agents.utils import common

from checkpointd.protocol import increments
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc as pb_grpc
from checkpointd_client import RemoteCheckpointer, training_saves
from tests.integration.support import training_state
from tests.integration.support.daemon import Daemon, start_daemon
from tests.integration.support.scrape import Metrics

LIMIT = 60.0
ROWS, WIDTH = 2048, 1024  # float32: 8 MiB, eight 1 MiB chunks
MiB = 1 << 20


class Trainer:
    """A training state, its big buffer, a RemoteCheckpointer over gRPC and an in-process Checkpointer beside it."""

    def __init__(self, daemon: Daemon, run: str, local: Path, **options: Any) -> None:
        self.state = training_state.build(seed=0)
        self.state.collect(20)
        self.buffer = tf.Variable(np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH), name="big")
        objects = {**self.state.objects, "big": self.buffer}
        options.setdefault("shared_memory", False)
        self.remote = RemoteCheckpointer(
            "train", daemon.address, run=run, max_to_keep=2, timeout=LIMIT, **options, **objects
        )
        self.local = common.Checkpointer(str(local), max_to_keep=2, **objects)
        self.ours = daemon.root / run / "train"
        self.run = self.remote.run  # the daemon run: <job>.train
        self.local_dir = local

    def rewrite(self, start: int, n: int, value: float) -> None:
        """Rows [start, start + n) modulo the capacity, as a ring buffer overwrites them."""
        rows = [(start + i) % ROWS for i in range(n)]
        self.buffer.scatter_nd_update([[r] for r in rows], tf.fill([n, WIDTH], value))

    def save(self) -> Any:
        result = self.remote.save(self.state.global_step, blocking=True).result(LIMIT)
        self.local.save(self.state.global_step)
        return result

    def same_files(self, step: int) -> bool:
        return all(
            filecmp.cmp(self.ours / f"ckpt-{step}{s}", self.local_dir / f"ckpt-{step}{s}", shallow=False)
            for s in (".index", ".data-00000-of-00001")
        )

    def close(self) -> None:
        self.remote.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The copying path always: these tests are about its copies (the per-save choice: test_incremental_paths.py)."""
    base = tmp_path_factory.mktemp("daemon")
    proc = start_daemon(base / "root", base / "work", "--incremental-path", "copy")
    try:
        yield proc
    finally:
        proc.terminate()


@pytest.fixture
def trainer(daemon: Daemon, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Trainer]:
    t = Trainer(daemon, request.node.name.replace("_", "-")[5:40], tmp_path / "train")
    yield t
    t.close()


def test_only_the_changed_chunks_travel_and_the_checkpoint_is_a_full_one(daemon: Daemon, trainer: Trainer) -> None:
    first = trainer.save()
    assert first.bytes_copied == 0 and trainer.same_files(first.step)
    trainer.rewrite(ROWS - 10, 30, 7.0)  # wraps: the last 10 rows and the first 20
    trainer.state.train(2)
    second = trainer.save()
    assert trainer.same_files(second.step)
    # Rows 2038-2047 and 0-19 lie in the first and last 1 MiB chunks: six of eight copied.
    assert second.bytes_copied >= 6 * MiB
    with grpc.insecure_channel(daemon.address) as channel:  # `status` says how much of the last save travelled
        [status] = pb_grpc.CheckpointServiceStub(channel).GetStatus(pb.StatusRequest(run=trainer.run)).runs
    assert (status.last_success.bytes_received, status.last_success.bytes_copied) == (
        second.bytes_received,
        second.bytes_copied,
    )
    metrics = Metrics(daemon.metrics_url)
    assert metrics("checkpointd_payload_copied_bytes_total", kind="training_checkpoint") >= second.bytes_copied
    assert metrics("checkpointd_payload_received_bytes_total", kind="training_checkpoint") >= second.bytes_received
    # The base replaced by the save that copies from it (same step: ckpt-N again), then deleted by retention.
    trainer.rewrite(500, 5, 1.0)
    third = trainer.save()
    assert third.step == second.step and third.bytes_copied >= 7 * MiB and trainer.same_files(third.step)
    trainer.state.train(1)
    fourth = trainer.save()
    trainer.state.train(1)
    fifth = trainer.save()  # max_to_keep 2: its base's base, ckpt-{second.step}, goes
    assert fifth.bytes_copied >= 8 * MiB
    for r in (fourth, fifth):
        assert trainer.same_files(r.step)
    fresh = tf.train.load_checkpoint(str(trainer.ours / f"ckpt-{fifth.step}"))
    assert float(fresh.get_tensor("big/.ATTRIBUTES/VARIABLE_VALUE")[500, 0]) == 1.0


def test_a_base_changed_on_disk_is_not_used(trainer: Trainer) -> None:
    first = trainer.save()
    data = trainer.ours / f"ckpt-{first.step}.data-00000-of-00001"
    with open(data, "r+b") as f:  # damaged after its commit: its identity no longer matches its manifest
        f.seek(2 * MiB + 5)
        f.write(b"\xff\xfe")
    trainer.rewrite(3, 1, 2.0)
    second = trainer.save()
    assert second.bytes_copied == 0 and trainer.same_files(second.step)


def test_a_base_written_to_during_the_save_makes_the_client_send_it_again_in_full(
    trainer: Trainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = trainer.save()
    data = trainer.ours / f"ckpt-{first.step}.data-00000-of-00001"
    real = increments.save_requests

    def tamper_first(*args: Any, **kwargs: Any) -> Iterator[bytes]:
        # After the accept offered the base (and the daemon opened and checked it), before its copies.
        fd = os.open(data, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\x01\x02\x03", MiB + 7)
        finally:
            os.close(fd)
        yield from real(*args, **kwargs)

    monkeypatch.setattr(training_saves.increments, "save_requests", tamper_first)
    trainer.rewrite(0, 1, 3.0)
    second = trainer.save()
    assert second.bytes_copied == 0  # the resent save, in full
    assert trainer.same_files(second.step)
    assert trainer.remote.counts.failed == 0 and trainer.remote.counts.durable == 2


def test_through_shared_memory_the_daemon_compares_the_chunks_and_copies_the_unchanged_ones(
    daemon: Daemon, tmp_path: Path
) -> None:
    t = Trainer(daemon, "through-shm", tmp_path / "train", shared_memory=True)
    try:
        first = t.save()
        assert first.bytes_copied == 0 and t.same_files(first.step)
        t.rewrite(ROWS - 3, 6, 8.0)  # wraps: the last chunk and the first
        t.state.train(1)
        second = t.save()
        assert t.same_files(second.step)
        assert second.bytes_copied >= 6 * MiB  # six of the eight chunks copied from the base
        saved = [line for line in daemon.log().splitlines() if "saved run=through-shm" in line]
        assert len(saved) == 2 and all("transport=shm" in line for line in saved)  # not over gRPC
        fresh = tf.train.load_checkpoint(str(t.ours / f"ckpt-{second.step}"))
        np.testing.assert_array_equal(fresh.get_tensor("big/.ATTRIBUTES/VARIABLE_VALUE"), t.buffer.numpy())
        t.rewrite(0, ROWS, 2.0)  # every byte of the buffer changed: nothing copied from it, still a full one
        third = t.save()
        assert t.same_files(third.step) and third.bytes_copied < 8 * MiB
    finally:
        t.close()


def test_incremental_off_sends_every_byte(daemon: Daemon, tmp_path: Path) -> None:
    t = Trainer(daemon, "incremental-off", tmp_path / "train", incremental=False)
    try:
        t.save()
        t.rewrite(1, 1, 4.0)
        second = t.save()
        assert second.bytes_copied == 0 and t.same_files(second.step)
    finally:
        t.close()


def test_a_restarted_daemon_copies_from_the_checkpoint_it_finds_on_disk(
    fresh_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    first_daemon = fresh_daemon("--incremental-path", "copy")
    t = Trainer(first_daemon, "restarted", tmp_path / "train")
    t.save()
    t.close()
    assert first_daemon.terminate() == 0
    second_daemon = fresh_daemon("--incremental-path", "copy")  # same root: the base is known from its manifest only
    t.remote = RemoteCheckpointer(
        "train", second_daemon.address, run="restarted", max_to_keep=2, timeout=LIMIT, shared_memory=False,
        **{**t.state.objects, "big": t.buffer},
    )  # fmt: skip
    t.remote.initialize_or_restore()
    t.rewrite(100, 3, 5.0)
    t.state.train(1)
    second = t.save()
    assert second.bytes_copied >= 7 * MiB and t.same_files(second.step)
    t.close()
