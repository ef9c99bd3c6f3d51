"""Resuming training after preemption, through the daemon: kill and resume, Learner, the tutorial.

- A trainer process is SIGKILLed mid-training after some checkpoints; a new
  process builds the same objects (other initial weights), restores from the
  daemon and continues. Its restored state equals the newest committed
  checkpoint, and with op determinism its continuation equals the killed
  process's own uninterrupted continuation from that checkpoint.
- A Learner loop swapped to the daemon in one line (`train_modules`)
  checkpoints every few steps and restores on restart.
- The "Checkpointer and PolicySaver" tutorial with both savers swapped runs
  end to end, restore in a new process included.
"""

from __future__ import annotations

import json
import pickle
import queue
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import tensorflow as tf

from checkpointd_client import train_modules
from tests.integration.support import dqn
from tests.integration.support.daemon import Daemon

LIMIT = 300.0


def _values_in_checkpoint(prefix: str) -> dict[str, bytes]:
    """What TensorFlow reads from a checkpoint, key by key, as training_state.values() gives it."""
    reader = tf.train.load_checkpoint(prefix)
    out = {}
    for key, dtype in reader.get_variable_to_dtype_map().items():
        if key == "_CHECKPOINTABLE_OBJECT_GRAPH" or key.startswith("save_counter/"):
            continue
        value = reader.get_tensor(key)
        out[key] = value if dtype == tf.string else np.ascontiguousarray(value).tobytes()
    return out


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        proc.kill()
        raise AssertionError(f"no line from {proc.args} within {timeout} s") from None


def _load(path: Path) -> dict[str, bytes]:
    return pickle.loads(path.read_bytes())


def test_a_killed_trainer_resumes_from_the_newest_checkpoint_and_continues_identically(
    daemon: Daemon, tmp_path: Path
) -> None:
    run = "resume-dqn"
    trainer = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.support.trainers.training_proc", "train", daemon.address, run, "3", "4", "6", str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = _first_line(trainer, LIMIT)
        assert line.startswith("ready "), line
        step = int(line.split()[1])
    finally:
        trainer.kill()  # SIGKILL, mid-training: its run is never closed
        trainer.wait(LIMIT)
    assert step == 12  # 3 rounds of 4 updates
    saved = _load(tmp_path / "saved.pickle")

    directory = daemon.root / run / "train"
    newest = tf.train.latest_checkpoint(str(directory))
    assert newest == str(directory / f"ckpt-{step}")
    assert _values_in_checkpoint(newest) == saved  # the newest committed checkpoint is the state at its save

    resumed = subprocess.run(
        [sys.executable, "-m", "tests.integration.support.trainers.training_proc", "resume", daemon.address, run, "6", str(tmp_path)],
        capture_output=True, text=True, timeout=LIMIT, check=False,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    restored = _load(tmp_path / "restored.pickle")
    assert [k for k in saved if restored.get(k) != saved[k]] == []  # train step, Adam slots, replay buffer, metrics
    assert any("_optimizer/_variables" in k for k in saved) and any("replay_buffer" in k for k in saved)
    uninterrupted, continued = _load(tmp_path / "uninterrupted.pickle"), _load(tmp_path / "resumed.pickle")
    assert continued != restored  # the continuation trained
    assert [k for k in uninterrupted if continued.get(k) != uninterrupted[k]] == []
    assert resumed.stdout.split() == ["resumed", str(step + 6)]


def test_a_learner_script_swapped_in_one_line_checkpoints_and_restores_on_restart(
    daemon: Daemon, tmp_path: Path
) -> None:
    run = "learner-dqn"
    root_dir = str(tmp_path / "root_dir")
    learner, triggers = train_modules(daemon.address, run=run, root_dir=root_dir, timeout=LIMIT)  # the one line

    first = dqn.build(seed=1)
    policy_trigger = triggers.PolicySavedModelTrigger(
        f"{root_dir}/{learner.POLICY_SAVED_MODEL_DIR}", first.agent, first.train_step, interval=5
    )
    job = learner.Learner(
        root_dir, first.train_step, first.agent, first.dataset_fn,
        triggers=[policy_trigger], checkpoint_interval=5, summary_interval=0, max_checkpoints_to_keep=2,
    )  # fmt: skip
    assert not job.checkpointer.checkpoint_exists
    for _ in range(3):
        job.run(iterations=5)
        # Saves are non-blocking: one still in flight when the next interval
        # comes makes that one a skip. Flushed here so each interval has its own.
        job.flush(LIMIT)
        policy_trigger.flush(LIMIT)
    weights = first.q_values()
    job.close()
    policy_trigger.close()

    folder = daemon.root / run
    assert tf.train.latest_checkpoint(str(folder / "train" / "checkpoints")).endswith("ckpt-15")
    kept = sorted(p.name for p in (folder / "train" / "checkpoints").glob("*.index"))
    assert kept == ["ckpt-10.index", "ckpt-15.index"]  # max_checkpoints_to_keep=2
    assert (folder / "policies" / "policy" / "saved_model.pb").is_file()
    assert (folder / "policies" / "checkpoints" / "policy_checkpoint_0000000015").is_dir()

    restarted = dqn.build(seed=2)  # other initial weights
    again = learner.Learner(
        root_dir, restarted.train_step, restarted.agent, restarted.dataset_fn,
        checkpoint_interval=5, summary_interval=0, max_checkpoints_to_keep=2,
    )  # fmt: skip
    try:
        assert again.checkpointer.checkpoint_exists
        assert int(restarted.train_step.numpy()) == 15
        for got, want in zip(restarted.q_values(), weights, strict=True):
            np.testing.assert_array_equal(got, want)
        again.run(iterations=5)  # and it goes on, checkpointing at 20
        again.flush(LIMIT)
    finally:
        again.close()
    assert tf.train.latest_checkpoint(str(folder / "train" / "checkpoints")).endswith("ckpt-20")


def test_the_checkpointer_and_policysaver_tutorial_runs_with_both_savers_swapped(
    daemon: Daemon, tmp_path: Path
) -> None:
    run = "tutorial"
    for mode, extra in (("train", []), ("restore", [str(daemon.root)])):
        done = subprocess.run(
            [sys.executable, "-m", "tests.integration.support.trainers.tutorial_proc", mode, daemon.address, run, str(tmp_path), *extra],
            capture_output=True, text=True, timeout=LIMIT, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{mode}: {done.stderr[-3000:]}"
    trained = json.loads((tmp_path / "train.json").read_text())
    restored = json.loads((tmp_path / "restore.json").read_text())
    assert trained["global_step"] == 5
    for key in ("global_step", "frames", "observations", "weights"):
        assert restored[key] == trained[key], key
    assert restored["global_step_from_graph"] == 5
    assert restored["policy_train_step"] == -1  # the tutorial's PolicySaver(agent.policy) has no train_step
    assert restored["episode_steps"] > 0
    files = sorted(p.name for p in (daemon.root / run / "checkpoint").iterdir())
    assert files == ["checkpoint", "ckpt-5.checkpointd.manifest.json", "ckpt-5.data-00000-of-00001", "ckpt-5.index"]
