"""The Learner swap as TF-Agents' own code calls it: keywords (its learner_test), PPOLearner's inner Learner, and
continuous saves through the swaps.

- `learner.Learner(root_dir=..., train_step=..., agent=...,
  experience_dataset_fn=..., checkpoint_interval=1)` from `train_modules`
  checkpoints through the daemon, as the positional call does.
- `tf_agents.train.ppo_learner.PPOLearner` builds its own `learner.Learner`;
  from `ppo_learner_module` that Learner checkpoints through the daemon.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tensorflow as tf
from tf_agents.agents.ppo import ppo_clip_agent
from tf_agents.environments import suite_gym, tf_py_environment
from tf_agents.networks import actor_distribution_network, value_network
from tf_agents.replay_buffers import tf_uniform_replay_buffer

from checkpointd_client import RemoteCheckpointer, common_module, ppo_learner_module, train_modules
from tests.integration.support import dqn
from tests.integration.support.daemon import Daemon

WAIT = 120.0  # seconds; every wait here is bounded by it


def test_the_learner_called_with_keywords_as_tf_agents_learner_test_does_checkpoints_through_the_daemon(
    daemon: Daemon, tmp_path: Path
) -> None:
    learner, _ = train_modules(daemon.address, run="keywords", timeout=WAIT)
    trainer = dqn.build(seed=3)
    job = learner.Learner(
        root_dir=str(tmp_path / "learner"),
        train_step=trainer.train_step,
        agent=trainer.agent,
        experience_dataset_fn=trainer.dataset_fn,
        checkpoint_interval=1,
        summary_interval=0,
    )
    try:
        assert isinstance(job.checkpointer, RemoteCheckpointer)
        assert not job.checkpointer.skip_if_busy  # Learner's synchronous Checkpointer never skips: neither does this
        job.run(iterations=1)  # the interval trigger saves at step 1
        job.flush(WAIT)
    finally:
        job.close(WAIT)
    newest = tf.train.latest_checkpoint(str(daemon.root / "keywords" / "train" / "checkpoints"))
    assert newest is not None and newest.endswith("ckpt-1")
    assert not (tmp_path / "learner" / "train" / "checkpoints").exists()  # nothing written locally


def _ppo_agent(train_step: tf.Variable) -> ppo_clip_agent.PPOClipAgent:
    env = tf_py_environment.TFPyEnvironment(suite_gym.load("CartPole-v0"))
    actor = actor_distribution_network.ActorDistributionNetwork(
        env.observation_spec(), env.action_spec(), fc_layer_params=(8,)
    )
    value = value_network.ValueNetwork(env.observation_spec(), fc_layer_params=(8,))
    agent = ppo_clip_agent.PPOClipAgent(
        env.time_step_spec(), env.action_spec(), optimizer=tf.keras.optimizers.Adam(1e-3), actor_net=actor,
        value_net=value, num_epochs=1, train_step_counter=train_step, update_normalizers_in_train=False,
    )  # fmt: skip
    agent.initialize()
    return agent


def test_ppo_learners_inner_learner_checkpoints_through_the_daemon(daemon: Daemon, tmp_path: Path) -> None:
    ppo_learner = ppo_learner_module(daemon.address, run="ppo", timeout=WAIT)  # the one line
    train_step = tf.Variable(0, dtype=tf.int64, name="train_step")
    agent = _ppo_agent(train_step)
    buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(agent.collect_data_spec, batch_size=1, max_length=64)

    def dataset_fn() -> tf.data.Dataset:
        return buffer.as_dataset(sample_batch_size=1, num_steps=4)

    job = ppo_learner.PPOLearner(
        str(tmp_path / "ppo"), train_step, agent, experience_dataset_fn=dataset_fn,
        normalization_dataset_fn=dataset_fn, num_samples=1, checkpoint_interval=1, summary_interval=0,
    )  # fmt: skip
    checkpointer = job.checkpointer
    try:
        assert isinstance(checkpointer, RemoteCheckpointer) and checkpointer.run == "ppo.train.checkpoints"
        assert not checkpointer.skip_if_busy  # Learner's synchronous Checkpointer never skips: neither does this
        train_step.assign(5)
        assert checkpointer.save(train_step, blocking=True).result(0) is not None
    finally:
        checkpointer.close(WAIT)
    assert "registered run=ppo.train.checkpoints" in daemon.log()
    newest = tf.train.latest_checkpoint(str(daemon.root / "ppo" / "train" / "checkpoints"))
    assert newest is not None and newest.endswith("ckpt-5")
    assert not (tmp_path / "ppo" / "train" / "checkpoints").exists()


def test_a_continuous_learner_saves_after_run_calls_within_the_budget_and_flush_saves_the_step_reached(
    daemon: Daemon, tmp_path: Path
) -> None:
    learner, _ = train_modules(daemon.address, run="continuous-learner", timeout=WAIT, continuous=True, budget=0.05)
    trainer = dqn.build(seed=3)
    job = learner.Learner(
        str(tmp_path / "learner"), trainer.train_step, trainer.agent, trainer.dataset_fn,
        checkpoint_interval=100_000, summary_interval=0,  # continuous: a save offered after every run()
    )  # fmt: skip
    try:
        runs = 60
        for _ in range(runs):
            job.run(iterations=1)
        decisions = job.checkpointer.decisions
        assert decisions is not None
        assert decisions.calls == runs
        assert decisions.saved >= 1 and decisions.calls - decisions.saved > 0
        job.flush(WAIT)  # saves the last run() not saved
    finally:
        job.close(WAIT)
    newest = tf.train.latest_checkpoint(str(daemon.root / "continuous-learner" / "train" / "checkpoints"))
    assert newest is not None and newest.endswith(f"ckpt-{runs}")


def test_a_budget_without_continuous_is_refused_by_the_swap_before_any_learner() -> None:
    with pytest.raises(ValueError, match="continuous=True"):
        train_modules("localhost:1", run="job", budget=0.1)
    with pytest.raises(ValueError, match="^budget must be"):
        train_modules("localhost:1", run="job", continuous=True, budget=2)


def test_common_modules_checkpointers_take_continuous_saves_too(daemon: Daemon) -> None:
    common = common_module(daemon.address, run="continuous-common", timeout=WAIT, continuous=True, budget=0.1)
    trainer = dqn.build(seed=3)
    checkpointer = common.Checkpointer("train", agent=trainer.agent, global_step=trainer.train_step)
    try:
        for _ in range(20):
            checkpointer.save(global_step=trainer.train_step)
        assert checkpointer.decisions is not None and checkpointer.decisions.saved >= 1
        assert checkpointer.decisions.calls == 20
    finally:
        common.close(WAIT)
