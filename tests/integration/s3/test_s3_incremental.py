"""Incremental training checkpoints on S3 (radosgw): unchanged ranges copied server-side from the base object.

A DQN training state plus a 40 MiB "replay buffer" variable whose rows are
rewritten between saves. Each checkpoint in the bucket must equal, byte for
byte, the one an in-process `common.Checkpointer.save` writes for the same
values, and load with TensorFlow from the objects alone; the bytes uploaded
are about what changed; a base deleted or replaced in the bucket before its
ranges are copied makes the client send the save in full, and only right
bytes are committed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tf_agents.utils import common

from checkpointd_client import RemoteCheckpointer
from tests.integration.s3.test_s3 import S3, s3  # noqa: F401  (the fixture)
from tests.integration.support import scrape, training_state
from tests.integration.support.daemon import Daemon
from tests.integration.support.raw import TIMEOUT

ROWS, WIDTH = 10240, 1024  # float32: 40 MiB, forty 1 MiB chunks, three 16 MiB parts
MiB = 1 << 20
SUFFIXES = (".index", ".data-00000-of-00001")


class Trainer:
    """A training state with its big buffer, checkpointed to the bucket and by an in-process Checkpointer beside it."""

    def __init__(self, env: S3, daemon: Daemon, run: str, local: Path) -> None:
        self.s3, self.daemon, self.run, self.local_dir = env, daemon, run, local
        self.state = training_state.build(seed=0)
        self.state.collect(20)
        self.buffer = tf.Variable(np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH), name="big")
        objects = {**self.state.objects, "big": self.buffer}
        self.remote = RemoteCheckpointer(
            "train", daemon.address, run=run, max_to_keep=2, timeout=TIMEOUT, shared_memory=False, **objects
        )
        self.local = common.Checkpointer(str(local), max_to_keep=2, **objects)

    def rewrite(self, start: int, n: int, value: float) -> None:
        """Rows [start, start + n) modulo the capacity, as a ring buffer overwrites them."""
        rows = [(start + i) % ROWS for i in range(n)]
        self.buffer.scatter_nd_update([[r] for r in rows], tf.fill([n, WIDTH], value))

    def save(self) -> Any:
        result = self.remote.save(self.state.global_step, blocking=True).result(TIMEOUT)
        self.local.save(self.state.global_step)
        return result

    def key(self, step: int, suffix: str) -> str:
        return f"{self.s3.prefix}/{self.run}/train/ckpt-{step}{suffix}"

    def same_objects(self, step: int) -> bool:
        """Whether the bucket's checkpoint has the in-process Checkpointer's bytes."""
        return all(
            self.s3.client.get_object(Bucket=self.s3.rgw.bucket, Key=self.key(step, s))["Body"].read()
            == (self.local_dir / f"ckpt-{step}{s}").read_bytes()
            for s in SUFFIXES
        )

    def uploaded(self) -> float:
        return scrape.Metrics(self.daemon.metrics_url)(
            "checkpointd_store_uploaded_bytes_total", kind="training_checkpoint"
        )

    def close(self) -> None:
        self.remote.close()


@pytest.fixture
def trainer(s3: S3, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Trainer]:  # noqa: F811
    # The copying path always: these tests are about its copies (the per-save choice: test_incremental_paths.py).
    t = Trainer(
        s3,
        s3.daemon("--incremental-path", "copy"),
        request.node.name.replace("_", "-")[5:30].strip("-[]"),
        tmp_path / "train",
    )
    try:
        yield t
    finally:
        t.close()


def test_unchanged_ranges_are_copied_in_the_bucket_and_the_checkpoint_is_a_full_one(
    trainer: Trainer, tmp_path: Path
) -> None:
    first = trainer.save()
    assert first.bytes_copied == 0 and trainer.same_objects(first.step)
    before = trainer.uploaded()
    trainer.rewrite(5000, 8, 3.0)  # 32 KiB in one 1 MiB chunk, in the middle of the file
    trainer.state.train(2)
    second = trainer.save()
    assert trainer.same_objects(second.step)
    assert second.bytes_copied >= 38 * MiB
    # Uploaded: the changed chunk and the agent's bytes, padded to one 5 MiB part, plus the index and manifest.
    agent = second.bytes_received
    assert trainer.uploaded() - before <= agent + 10 * MiB + (1 << 20)
    trainer.rewrite(ROWS - 4, 10, 5.0)  # wraps: the last chunk and the first
    trainer.state.train(1)
    third = trainer.save()
    assert trainer.same_objects(third.step) and third.bytes_copied >= 36 * MiB
    # Loadable by TensorFlow from the bucket's objects alone (the base, ckpt-{second.step}, is not there).
    for s in SUFFIXES:
        data = trainer.s3.client.get_object(Bucket=trainer.s3.rgw.bucket, Key=trainer.key(third.step, s))["Body"]
        (tmp_path / f"fetched{s}").write_bytes(data.read())
    reader = tf.train.load_checkpoint(str(tmp_path / "fetched"))
    big = reader.get_tensor("big/.ATTRIBUTES/VARIABLE_VALUE")
    np.testing.assert_array_equal(big, trainer.buffer.numpy())
    assert float(big[2, 0]) == 5.0 and float(big[5000, 0]) == 3.0


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_base_object_gone_or_replaced_in_the_bucket_makes_the_save_go_in_full(trainer: Trainer, how: str) -> None:
    first = trainer.save()
    key = trainer.key(first.step, SUFFIXES[1])
    bucket, client = trainer.s3.rgw.bucket, trainer.s3.client
    # Its manifest still names it (so the daemon offers it), but the object is not the one it committed.
    if how == "deleted":
        client.delete_object(Bucket=bucket, Key=key)
    else:
        body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        body[3 * MiB] ^= 0xFF
        client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    trainer.rewrite(100, 2, 9.0)
    trainer.state.train(1)
    second = trainer.save()
    assert second.bytes_copied == 0  # sent again in full, within the same ticket
    assert trainer.same_objects(second.step)
    # The next save copies from that full one.
    trainer.rewrite(200, 2, 4.0)
    trainer.state.train(1)
    third = trainer.save()
    assert third.bytes_copied >= 38 * MiB and trainer.same_objects(third.step)
