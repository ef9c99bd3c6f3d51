"""RemoteCheckpointer against a real daemon: a tf.train.Checkpoint saved, laid out and restored.

The smallest objects that exercise the path end to end (a variable, a step,
a NumpyState); the TF-Agents fidelity tests (DQN, Adam, replay buffer,
metrics) are in test_training_fidelity.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import tensorflow as tf
from tf_agents.utils import numpy_storage

from checkpointd.protocol import wire
from checkpointd.protocol.kinds import SaveKind
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import RemoteCheckpointer, SaveTicket
from checkpointd_client import tf_checkpoint as client_training
from tests.integration.support.daemon import Daemon, wait_until
from tests.integration.support.raw import RawSave, Stub, counts, run_status
from tests.integration.support.scrape import Metrics

LIMIT = 60.0
CHECKPOINTD = str(Path(sys.executable).with_name("checkpointd"))


def _objects(seed: int = 0) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    state = numpy_storage.NumpyState()
    state.counts = rng.integers(0, 100, size=(7,), dtype=np.int64)
    return {
        "weights": tf.Variable(rng.standard_normal((3, 4)).astype(np.float32)),
        "global_step": tf.Variable(0, dtype=tf.int64),
        "state": state,
    }


def test_a_checkpoint_saved_through_the_daemon_restores_into_fresh_objects(daemon: Daemon) -> None:
    saved = _objects(seed=1)
    saved["global_step"].assign(12)  # type: ignore[attr-defined]
    with RemoteCheckpointer("train", daemon.address, run="tc-basic", timeout=LIMIT, **saved) as ckpt:
        assert not ckpt.checkpoint_exists
        ticket = ckpt.save(saved["global_step"], blocking=True)
        result = ticket.result()
        assert result is not None and result.kind is SaveKind.TRAINING_CHECKPOINT
        assert ticket.export_dir == "train/ckpt-12" and result.step == 12
        assert result.path == str(daemon.root.resolve() / "tc-basic" / "train" / "ckpt-12")
    files = sorted(os.listdir(daemon.root / "tc-basic" / "train"))
    assert files == ["checkpoint", "ckpt-12.checkpointd.manifest.json", "ckpt-12.data-00000-of-00001", "ckpt-12.index"]

    fresh = _objects(seed=2)
    with RemoteCheckpointer("train", daemon.address, run="tc-basic", timeout=LIMIT, **fresh) as again:
        assert again.checkpoint_exists
        again.initialize_or_restore()
        assert again.manager.latest_checkpoint == result.path
    np.testing.assert_array_equal(fresh["weights"].numpy(), saved["weights"].numpy())  # type: ignore[attr-defined]
    assert fresh["global_step"].numpy() == 12  # type: ignore[attr-defined]
    np.testing.assert_array_equal(fresh["state"].counts, saved["state"].counts)  # type: ignore[attr-defined]


def test_tensorflow_reads_the_daemons_checkpoint_dir_on_its_own(daemon: Daemon, tmp_path: Path) -> None:
    objects = _objects(seed=3)
    with RemoteCheckpointer("ckpts", daemon.address, run="tc-tf", timeout=LIMIT, **objects) as ckpt:
        for step in (1, 2):
            objects["global_step"].assign(step)  # type: ignore[attr-defined]
            ckpt.save(objects["global_step"], blocking=True)
    directory = str(daemon.root / "tc-tf" / "ckpts")
    latest = tf.train.latest_checkpoint(directory)
    assert latest is not None and latest.endswith("ckpt-2")
    fresh = _objects(seed=4)
    tf.train.Checkpoint(**fresh).restore(latest).assert_consumed()
    assert fresh["global_step"].numpy() == 2  # type: ignore[attr-defined]
    np.testing.assert_array_equal(fresh["weights"].numpy(), objects["weights"].numpy())  # type: ignore[attr-defined]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CHECKPOINTD, *args], capture_output=True, text=True, timeout=LIMIT, check=False)


def test_metrics_status_and_verify_cover_the_training_checkpoint_kind(daemon: Daemon) -> None:
    before = Metrics(daemon.metrics_url)
    assert before("checkpointd_saves_total", kind="training_checkpoint", outcome="ok") >= 0  # exists from the start
    objects = _objects(seed=5)
    with RemoteCheckpointer("train", daemon.address, run="tc-ops", timeout=LIMIT, **objects) as ckpt:
        ckpt.save(1, blocking=True)
        status = _cli("status", "--address", daemon.address, "--run", ckpt.run)
        assert ckpt.run == "tc-ops.train"  # the job's checkpointer of "train" (checkpointd_client.transport.streams)
        assert status.returncode == 0, status.stderr
        assert "tc-ops" in status.stdout and "step 1" in status.stdout
        ckpt.save(2, blocking=True)
    after = Metrics(daemon.metrics_url)
    ok = after("checkpointd_saves_total", kind="training_checkpoint", outcome="ok")
    assert ok - before("checkpointd_saves_total", kind="training_checkpoint", outcome="ok") == 2
    assert after("checkpointd_save_duration_seconds_count", kind="training_checkpoint") >= 2
    assert after("checkpointd_written_bytes_total", kind="training_checkpoint") > 0

    directory = daemon.root / "tc-ops" / "train"
    verified = _cli("verify", str(directory))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "training_checkpoint, step 2" in verified.stdout and "2 OK, 0 FAILED" in verified.stdout
    (directory / "ckpt-2.data-00000-of-00001").write_bytes(b"torn")
    broken = _cli("verify", str(directory / "ckpt-2"))
    assert broken.returncode == 1 and "FAILED" in broken.stdout and "ckpt-2.data-00000-of-00001" in broken.stdout


@contextlib.contextmanager
def _held_save(daemon: Daemon, ckpt: RemoteCheckpointer) -> Iterator[Callable[[], None]]:
    """A save of the checkpointer's run, accepted and then silent: its lane is busy until the block calls finish()."""
    state = client_training.describe(ckpt.checkpoint)
    header = pb.SaveHeader(
        run=ckpt.run, kind=pb.TRAINING_CHECKPOINT, export_dir="train", step=1,
        snapshot_bytes=state.nbytes, training_checkpoint=state.to_proto(20, None),
    )  # fmt: skip
    with (
        grpc.insecure_channel(daemon.address) as channel,
        RawSave(Stub(channel), pb.SaveRequest(header=header)) as held,
    ):
        assert held.decision().accepted
        yield lambda: held.finish(list(wire.chunks(state.copy(), 1 << 20)))


def test_a_save_while_one_is_in_flight_is_skipped_and_a_blocking_one_waits_its_turn(daemon: Daemon) -> None:
    objects = _objects(seed=6)
    with RemoteCheckpointer("train", daemon.address, run="tc-lane", timeout=LIMIT, **objects) as ckpt:
        run = ckpt.run
        with _held_save(daemon, ckpt) as finish:
            counter = int(ckpt.checkpoint.save_counter.numpy())
            skipped = ckpt.save(2)
            assert skipped.skipped and skipped.result() is None and skipped.reason
            assert int(ckpt.checkpoint.save_counter.numpy()) == counter  # nothing was saved
            waiting: list[SaveTicket] = []
            blocked = threading.Thread(target=lambda: waiting.append(ckpt.save(3, blocking=True)))
            blocked.start()
            wait_until(lambda: run_status(daemon, run).in_flight.waiting == 1, "the blocking save queued")
            assert not waiting
            finish()
            blocked.join(LIMIT)
        (ticket,) = waiting
        assert ticket.result() is not None and ticket.step == 3
    assert counts(daemon, run) == (2, 1, 0)
    assert tf.train.latest_checkpoint(str(daemon.root / "tc-lane" / "train")).endswith("ckpt-3")


def test_a_checkpointer_that_does_not_skip_waits_for_its_save_in_flight_then_hands_off(daemon: Daemon) -> None:
    """skip_if_busy=False (common_module's drop-in for the synchronous common.Checkpointer): never skipped."""
    objects = _objects(seed=7)
    with RemoteCheckpointer(
        "train", daemon.address, run="tc-wait", timeout=LIMIT, skip_if_busy=False, **objects
    ) as ckpt:
        run = ckpt.run
        with _held_save(daemon, ckpt) as finish:
            saved: list[SaveTicket] = []
            saving = threading.Thread(target=lambda: saved.append(ckpt.save(2)))  # not blocking
            saving.start()
            wait_until(lambda: run_status(daemon, run).in_flight.waiting == 1, "the save queued, not skipped")
            assert not saved
            finish()
            saving.join(LIMIT)
        (ticket,) = saved
        assert not ticket.skipped and ticket.result() is not None and ticket.step == 2
    assert counts(daemon, run) == (2, 0, 0)
    assert tf.train.latest_checkpoint(str(daemon.root / "tc-wait" / "train")).endswith("ckpt-2")
