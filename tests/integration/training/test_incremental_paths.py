"""Each path an incremental save can take gives the checkpoint a full save gives, and says which it took.

A daemon per path (`--incremental-path copy|receive|auto`; clone on a file
system that shares extents, where the machine has one mounted:
CHECKPOINTD_REFLINK_DIR), the training state of test_incremental_saves with
its 8 MiB buffer, and an in-process `common.Checkpointer` beside it: every
committed checkpoint equals its files byte for byte, and reads back into the
trainer's variables with the values saved. On S3 (radosgw), the
server-side copy and the full upload give the in-process Checkpointer's
objects.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tests.integration.s3.test_s3 import S3, s3  # noqa: F401  (the fixture)
from tests.integration.s3.test_s3_incremental import Trainer as S3Trainer
from tests.integration.support.daemon import Daemon, start_daemon
from tests.integration.support.scrape import Metrics
from tests.integration.training.test_incremental_saves import Trainer

MiB = 1 << 20


def _two_saves(trainer: Trainer) -> tuple[object, object]:
    first = trainer.save()
    trainer.rewrite(100, 20, 3.0)  # rows 100-119: in the first chunk; seven of eight unchanged
    trainer.state.train(1)
    return first, trainer.save()


def _reads_back(trainer: Trainer, step: int) -> bool:
    """Whether the daemon's checkpoint restores the buffer's values into a fresh variable."""
    restored = tf.Variable(tf.zeros_like(trainer.buffer))
    tf.train.Checkpoint(big=restored).read(str(trainer.ours / f"ckpt-{step}")).expect_partial()
    return bool(np.array_equal(restored.numpy(), trainer.buffer.numpy()))


@pytest.fixture
def make_trainer(tmp_path: Path) -> Iterator[Callable[..., tuple[Daemon, Trainer]]]:
    made: list[tuple[Daemon, Trainer]] = []
    elsewhere: list[Path] = []  # roots outside tmp_path (on the reflink file system)

    def make(choice: str, *, shared_memory: bool = False, root: Path | None = None) -> tuple[Daemon, Trainer]:
        n = len(made)
        if root is not None:
            elsewhere.append(root)
        daemon = start_daemon(root or tmp_path / f"root{n}", tmp_path / f"work{n}", "--incremental-path", choice)
        try:
            trainer = Trainer(daemon, f"paths-{n}", tmp_path / f"train{n}", shared_memory=shared_memory)
        except BaseException:
            daemon.terminate()
            raise
        made.append((daemon, trainer))
        return daemon, trainer

    yield make
    for daemon, trainer in made:
        try:
            trainer.close()
        finally:
            daemon.terminate()
    for root in elsewhere:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(
    ("choice", "shared_memory", "path"),
    [("copy", False, "copy"), ("receive", False, "receive"), ("copy", True, "copy"), ("receive", True, "receive")],
    ids=["copy-grpc", "receive-grpc", "copy-shm", "receive-shm"],
)
def test_a_fixed_path_is_taken_reported_and_commits_a_full_checkpoint(
    make_trainer, choice: str, shared_memory: bool, path: str
) -> None:
    daemon, trainer = make_trainer(choice, shared_memory=shared_memory)
    first, second = _two_saves(trainer)
    assert first.incremental_path == "no_base" and first.bytes_copied == 0
    assert second.incremental_path == path
    if path == "copy":
        assert second.bytes_copied >= 7 * MiB
    else:
        assert second.bytes_copied == 0 and second.bytes_received >= 8 * MiB
    assert trainer.same_files(first.step) and trainer.same_files(second.step)
    assert _reads_back(trainer, second.step)
    metrics = Metrics(daemon.metrics_url)
    assert metrics("checkpointd_incremental_path_total", kind="training_checkpoint", route=path) == 1
    assert metrics("checkpointd_incremental_path_total", kind="training_checkpoint", route="no_base") == 1


def test_auto_chooses_a_path_per_save_and_every_checkpoint_is_a_full_one(make_trainer) -> None:
    daemon, trainer = make_trainer("auto")
    first, second = _two_saves(trainer)
    paths = [first.incremental_path, second.incremental_path]
    for n in range(4):
        trainer.rewrite(300 * n, 10, float(n))
        trainer.state.train(1)
        result = trainer.save()
        paths.append(result.incremental_path)
        assert trainer.same_files(result.step) and _reads_back(trainer, result.step)
        assert (result.bytes_copied > 0) == (result.incremental_path == "copy")
    # The root's own way until receiving is priced and copying by three saves (ChooserConfig.samples).
    assert paths[:4] == ["no_base", "copy", "copy", "copy"]
    assert set(paths[4:]) <= {"copy", "receive"}
    metrics = Metrics(daemon.metrics_url)
    counted = {
        p: metrics("checkpointd_incremental_path_total", kind="training_checkpoint", route=p) for p in set(paths)
    }
    assert counted == {p: paths.count(p) for p in set(paths)}


def _reflink_dir() -> Path | None:
    where = os.environ.get("CHECKPOINTD_REFLINK_DIR")
    return Path(where) if where else None


@pytest.mark.skipif(_reflink_dir() is None, reason="no reflink file system mounted (CHECKPOINTD_REFLINK_DIR)")
def test_on_a_file_system_that_shares_extents_the_unchanged_chunks_are_cloned(make_trainer) -> None:
    where = _reflink_dir()
    assert where is not None
    _, trainer = make_trainer("copy", root=where / f"root-{uuid.uuid4().hex[:8]}")
    first, second = _two_saves(trainer)
    assert (first.incremental_path, second.incremental_path) == ("no_base", "clone")
    assert second.bytes_copied >= 7 * MiB
    assert trainer.same_files(second.step) and _reads_back(trainer, second.step)


@pytest.mark.parametrize(("choice", "path"), [("copy", "server_copy"), ("receive", "receive")])
def test_on_s3_the_unchanged_ranges_are_copied_in_the_bucket_or_received(
    s3: S3,  # noqa: F811
    tmp_path: Path,
    choice: str,
    path: str,
) -> None:
    trainer = S3Trainer(s3, s3.daemon("--incremental-path", choice), f"s3-paths-{choice}", tmp_path / "train")
    try:
        first = trainer.save()
        trainer.rewrite(5000, 8, 3.0)
        trainer.state.train(1)
        second = trainer.save()
        assert (first.incremental_path, second.incremental_path) == ("no_base", path)
        assert (second.bytes_copied >= 38 * MiB) == (path == "server_copy")
        assert trainer.same_objects(first.step) and trainer.same_objects(second.step)
    finally:
        trainer.close()
