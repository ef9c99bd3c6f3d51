"""Shared-memory training checkpoints written with O_DIRECT: TensorFlow's files, and the page-cache way where refused.

The daemon lays a training checkpoint's segment out as an image of its data
file and writes it past the page cache (`checkpointd.durable.direct`). A
training state (DQN, Adam slots, a replay buffer, a py metric's NumpyState:
a string tensor) plus variables of odd sizes, so that no tensor starts on a
block boundary, is saved twice through shared memory, values changed in
between; each checkpoint must equal, byte for byte, the one an in-process
`common.Checkpointer.save` (`tf.train.Checkpoint`'s write, with its save
counter) writes for the same values. That the data file did not go through
the page cache is read from the kernel (mincore). A daemon whose O_DIRECT
opens fail with EINVAL, as on file systems that refuse it, writes the same
files through the page cache.
"""

from __future__ import annotations

import ctypes
import filecmp
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tf_agents.utils import common

from checkpointd_client import RemoteCheckpointer
from tests.integration.support import training_state
from tests.integration.support.daemon import Daemon, start_daemon
from tests.integration.support.scrape import Metrics

LIMIT = 60.0
SUFFIXES = (".index", ".data-00000-of-00001")
# Imported by the refusing daemon before anything else: its O_DIRECT opens fail as such a file system's do.
REFUSE_O_DIRECT = """\
import errno
import os

_open = os.open


def _refusing(path, flags, *args, **kwargs):
    if flags & os.O_DIRECT:
        raise OSError(errno.EINVAL, "Invalid argument (O_DIRECT refused by the test)")
    return _open(path, flags, *args, **kwargs)


os.open = _refusing
"""


def resident_pages(path: Path) -> tuple[int, int]:
    """(pages of `path` in the page cache, pages of `path`), as mincore(2) reports them."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        anchor = ctypes.c_char.from_buffer(m)  # mapped, never touched: no page is read in
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.addressof(anchor), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del anchor
    return sum(v & 1 for v in vec), pages


class Trainer:
    """A training state plus odd-sized variables, saved through the daemon's shared memory and in process."""

    def __init__(self, daemon: Daemon, run: str, local: Path, *, incremental: bool = False) -> None:
        self.state = training_state.build(seed=0)
        self.state.collect(20)
        self.state.train(2)
        rng = np.random.default_rng(0)
        self.odd = [
            tf.Variable(rng.standard_normal(3_000_001).astype(np.float32)),  # 12 MB: past the writeback threshold
            tf.Variable(rng.integers(0, 1 << 40, 77_777, dtype=np.int64)),
            tf.Variable(rng.standard_normal((3, 5))),
        ]
        objects = {**self.state.objects, "odd": self.odd}
        self.remote = RemoteCheckpointer(
            "train", daemon.address, run=run, max_to_keep=2, timeout=LIMIT, incremental=incremental, **objects
        )
        self.local = common.Checkpointer(str(local), max_to_keep=2, **objects)
        self.ours = daemon.root / run / "train"
        self.local_dir = local

    def save(self) -> int:
        """Saves through the daemon and in process; returns the step."""
        return self.save_result().step

    def save_result(self) -> Any:
        """Saves through the daemon and in process; returns the daemon's result."""
        result = self.remote.save(self.state.global_step, blocking=True).result(LIMIT)
        self.local.save(self.state.global_step)
        return result

    def change(self) -> None:
        self.state.collect(3)
        self.state.train(1)
        self.odd[0].assign_add(tf.ones_like(self.odd[0]))

    def same_files(self, step: int) -> bool:
        return all(
            filecmp.cmp(self.ours / f"ckpt-{step}{s}", self.local_dir / f"ckpt-{step}{s}", shallow=False)
            for s in SUFFIXES
        )

    def data_file(self, step: int) -> Path:
        return self.ours / f"ckpt-{step}{SUFFIXES[1]}"


def _shm_snapshots(daemon: Daemon) -> float:
    return Metrics(daemon.metrics_url)(
        "checkpointd_snapshots_received_total", kind="training_checkpoint", transport="shm"
    )


@pytest.fixture
def trainer_of(tmp_path: Path) -> Iterator[Any]:
    made: list[Trainer] = []

    def make(daemon: Daemon, run: str, **options: Any) -> Trainer:
        made.append(Trainer(daemon, run, tmp_path / f"local-{run}", **options))
        return made[-1]

    try:
        yield make
    finally:
        for t in made:
            t.remote.close()


def test_a_checkpoint_written_past_the_page_cache_is_tensorflows_byte_for_byte(daemon: Daemon, trainer_of: Any) -> None:
    trainer = trainer_of(daemon, "direct")
    first = trainer.save()
    trainer.change()
    second = trainer.save()
    assert second != first
    assert _shm_snapshots(daemon) >= 2
    for step in (first, second):  # before the files are read to compare them
        resident, pages = resident_pages(trainer.data_file(step))
        assert pages > 2900 and resident <= 2, (step, resident, pages)  # at most the object graph's last block
    assert trainer.same_files(first) and trainer.same_files(second)


def test_an_incremental_save_in_an_image_is_written_whole_where_the_root_would_copy_in_the_kernel(
    daemon: Daemon, trainer_of: Any
) -> None:
    # ext4 (the tests' root) has no reflink: a base's unchanged chunks would be read and written again.
    trainer = trainer_of(daemon, "image-incremental", incremental=True)
    first = trainer.save_result()
    trainer.change()
    second = trainer.save_result()
    assert (first.incremental_path, second.incremental_path) == ("no_base", "receive")
    assert second.bytes_copied == 0
    resident, _ = resident_pages(trainer.data_file(second.step))
    assert resident <= 2
    assert trainer.same_files(first.step) and trainer.same_files(second.step)


@pytest.fixture(scope="module")
def refusing_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    base = tmp_path_factory.mktemp("refusing")
    (base / "site").mkdir()
    (base / "site" / "sitecustomize.py").write_text(REFUSE_O_DIRECT)
    path = os.pathsep.join(p for p in (str(base / "site"), os.environ.get("PYTHONPATH", "")) if p)
    proc = start_daemon(base / "root", base / "work", env={"PYTHONPATH": path})
    try:
        yield proc
    finally:
        proc.terminate()


def test_where_o_direct_is_refused_the_same_files_are_written_through_the_page_cache(
    refusing_daemon: Daemon, trainer_of: Any
) -> None:
    trainer = trainer_of(refusing_daemon, "refused")
    first = trainer.save()
    trainer.change()
    second = trainer.save()
    assert _shm_snapshots(refusing_daemon) >= 2
    for step in (first, second):  # before the files are read to compare them
        resident, pages = resident_pages(trainer.data_file(step))
        assert resident > pages // 2, (step, resident, pages)  # written buffered: still in the page cache
    assert trainer.same_files(first) and trainer.same_files(second)
    assert refusing_daemon.log().count("refuses O_DIRECT") == 1  # tried once per device, then not again
