"""RemotePolicySavedModelTrigger in a real tf_agents Learner, against upstream's trigger.

Both triggers ride the same Learner over the same DQN agent, so at every call
they see the same values: the daemon's tree must be upstream's (plus save
manifests), with byte-identical variables. Then a trainer process is killed
with SIGKILL and a new one resumes from the daemon's newest checkpoint.
"""

from __future__ import annotations

import filecmp
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tf_agents.metrics import py_metrics
from tf_agents.policies import policy_loader, py_tf_eager_policy
from tf_agents.train import triggers
from tf_agents.trajectories import time_step as ts
from tf_agents.utils import numpy_storage

from checkpointd.storage import save_manifest
from checkpointd_client import SaveKind
from checkpointd_client.trigger import RemotePolicySavedModelTrigger
from tests.integration.support import dqn
from tests.integration.support.daemon import Daemon
from tests.integration.support.raw import TIMEOUT
from tests.integration.support.trainers import trainer_proc

INTERVAL = 2
ENV_STEP = triggers.ENV_STEP_METADATA_KEY
CHILD_TIMEOUT = 240.0  # a fresh interpreter imports TF, builds DQN, exports three templates
REPO = Path(__file__).resolve().parents[3]


def tree(root: Path) -> set[str]:
    """Every file under `root`, relative, without the daemon's save manifests."""
    return {
        os.path.relpath(os.path.join(d, f), root)
        for d, _, files in os.walk(root)
        for f in files
        if f != save_manifest.MANIFEST_NAME
    }


def checkpoint(step: int) -> str:
    return f"policies/checkpoints/policy_checkpoint_{step:010d}"


def test_the_trigger_writes_what_upstream_writes_in_a_learner_loop(daemon: Daemon, tmp_path: Path) -> None:
    trainer = dqn.build(seed=0)
    ours_metric, upstream_metric = py_metrics.CounterMetric(), py_metrics.CounterMetric()
    with pytest.raises(NotImplementedError):  # upstream refuses what the remote trigger does
        triggers.PolicySavedModelTrigger(
            str(tmp_path / "refused"), trainer.agent, trainer.train_step, INTERVAL,
            async_saving=True, metadata_metrics={ENV_STEP: upstream_metric},
        )  # fmt: skip
    upstream_dir = tmp_path / "upstream"
    upstream = triggers.PolicySavedModelTrigger(
        str(upstream_dir / "policies"), trainer.agent, trainer.train_step, INTERVAL,
        metadata_metrics={ENV_STEP: upstream_metric},
    )  # fmt: skip
    ours = RemotePolicySavedModelTrigger(
        "policies", trainer.agent, trainer.train_step, INTERVAL, async_saving=True,
        metadata_metrics={ENV_STEP: ours_metric}, address=daemon.address, run="trig",
        timeout=TIMEOUT,
    )  # fmt: skip
    try:
        learner = trainer.learner(tmp_path / "learner", [upstream, ours])
        for _ in range(3):
            ours_metric(), upstream_metric()
            learner.run(iterations=INTERVAL)
            # Durable before the next round, so no periodic save is skipped as busy.
            assert ours.last_ticket.result().step == trainer.train_step.numpy()
        learner.run(iterations=1)  # step 7: not a multiple of the interval, nothing saved
        assert ours.last_ticket.step == 6
        upstream(7, force_trigger=True)
        ours(7, force_trigger=True)  # the final save: blocking
        assert ours.last_ticket.done() and ours.last_ticket.result().step == 7
    finally:
        ours.close()

    run_dir = daemon.root / "trig"
    expected = {f"policies/{p}" for p in ("policy", "collect_policy", "greedy_policy")}
    expected |= {checkpoint(s) for s in (2, 4, 6, 7)}
    assert tree(run_dir) == tree(upstream_dir)
    for save in expected:
        for name in ("variables.index", "variables.data-00000-of-00001"):
            ours_file, upstream_file = (d / save / "variables" / name for d in (run_dir, upstream_dir))
            assert filecmp.cmp(ours_file, upstream_file, shallow=False), (save, name)
    manifests = {p.parent.relative_to(run_dir).as_posix() for p in run_dir.rglob(save_manifest.MANIFEST_NAME)}
    assert manifests == expected

    # TF-Agents' loaders: any saved policy updates from the raw policy's checkpoints.
    raw = py_tf_eager_policy.SavedModelPyTFEagerPolicy(str(run_dir / "policies/policy"), load_specs_from_pbtxt=True)
    raw.update_from_checkpoint(str(run_dir / checkpoint(6)))
    assert raw.get_train_step() == 6 and int(raw.get_metadata()[ENV_STEP]) == 3
    loaded_raw = policy_loader.load(str(run_dir / "policies/policy"), str(run_dir / checkpoint(7)))
    assert loaded_raw.get_train_step() == 7
    greedy = py_tf_eager_policy.SavedModelPyTFEagerPolicy(
        str(run_dir / "policies/greedy_policy"), load_specs_from_pbtxt=True
    )
    greedy.update_from_checkpoint(str(run_dir / checkpoint(7)))
    observations = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    step = ts.restart(tf.constant(observations), batch_size=16)
    live = trainer.agent.policy.action(step).action.numpy()
    loaded = tf.saved_model.load(str(run_dir / "policies/greedy_policy"))
    assert int(loaded.get_train_step()) == 0  # the initial SavedModel, as upstream's
    for i in range(16):
        one = ts.restart(observations[i], batch_size=None)
        assert int(greedy.action(one).action) == live[i]


def _started(proc: subprocess.Popen, timeout: float) -> str:
    """The child's first stdout line, or a failure with its stderr."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        proc.kill()
        pytest.fail(f"the trainer printed nothing in {timeout:g}s")
    if not line:
        proc.wait()
        pytest.fail(f"the trainer exited with {proc.returncode}:\n{proc.stderr.read()[-4000:]}")
    return line.strip()


def test_a_killed_trainer_resumes_from_the_daemons_newest_checkpoint(daemon: Daemon, tmp_path: Path) -> None:
    rounds = 2
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.support.trainers.trainer_proc", daemon.address, "resume",
         str(rounds), str(INTERVAL), str(tmp_path / "killed")],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert _started(proc, CHILD_TIMEOUT) == f"durable {rounds * INTERVAL}"
    finally:
        proc.kill()  # SIGKILL: no flush, no close, no goodbye
        proc.wait()
        proc.stdin.close(), proc.stdout.close(), proc.stderr.close()
    last = rounds * INTERVAL
    run_dir = daemon.root / "resume"
    created = {p: save_manifest.read_manifest(run_dir / "policies" / p)["created_unix_seconds"]
               for p in ("policy", "collect_policy", "greedy_policy")}  # fmt: skip

    trainer = dqn.build(seed=2)  # other initial weights than the killed trainer's
    state = numpy_storage.NumpyState()
    trigger = RemotePolicySavedModelTrigger(
        "policies", trainer.agent, trainer.train_step, INTERVAL,
        address=daemon.address, run="resume", numpy_state=state, timeout=TIMEOUT,
    )  # fmt: skip
    try:
        for p, when in created.items():  # as upstream, existing SavedModels are not rewritten
            assert save_manifest.read_manifest(run_dir / "policies" / p)["created_unix_seconds"] == when
        newest = trigger.latest()
        assert (newest.export_dir, newest.step, newest.kind) == (checkpoint(last), last, SaveKind.CHECKPOINT)
        reader = tf.train.load_checkpoint(str(run_dir / checkpoint(last) / "variables" / "variables"))
        q_before = trainer.q_values()

        restored = trigger.restore()

        assert restored.step == last and int(trainer.train_step.numpy()) == last
        for b in trigger.saver._bindings.variables:  # noqa: SLF001 - each variable and its key
            assert b.variable.numpy().tobytes() == reader.get_tensor(b.checkpoint_key).tobytes(), b.key
        assert any(a.tobytes() != b.tobytes() for a, b in zip(q_before, trainer.q_values(), strict=True))
        np.testing.assert_array_equal(state.episodes, trainer_proc.episodes(rounds))

        learner = trainer.learner(tmp_path / "resumed", [trigger])
        learner.run(iterations=INTERVAL)
        assert trigger.last_ticket.result().step == last + INTERVAL
        assert trigger.latest().export_dir == checkpoint(last + INTERVAL)
    finally:
        trigger.close()
