"""A tiny real DQN on CartPole for trigger and restore tests: agent, replay data, Learner."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorflow as tf
from tf_agents.agents.dqn import dqn_agent
from tf_agents.drivers import dynamic_step_driver
from tf_agents.environments import suite_gym, tf_py_environment
from tf_agents.networks import q_network
from tf_agents.policies import random_tf_policy
from tf_agents.replay_buffers import tf_uniform_replay_buffer
from tf_agents.train import learner
from tf_agents.utils import common

COLLECT_STEPS = 64
BATCH = 8


@dataclass
class Trainer:
    agent: dqn_agent.DqnAgent
    train_step: tf.Variable
    dataset_fn: Callable[[], tf.data.Dataset]

    def learner(self, root_dir: Path, triggers: Sequence[Callable[..., None]]) -> learner.Learner:
        """A Learner whose own checkpoints (train/) stay in `root_dir`, never restored from."""
        return learner.Learner(
            str(root_dir), self.train_step, self.agent, self.dataset_fn,
            triggers=list(triggers), checkpoint_interval=-1, summary_interval=0,
        )  # fmt: skip

    def q_values(self) -> list[np.ndarray]:
        """The Q-network's variables (the raw policy's), in a fixed order."""
        return [v.numpy() for v in self.agent.policy.variables()]


def build(seed: int = 0, hidden: tuple[int, ...] = (16,)) -> Trainer:
    """A DqnAgent with a replay buffer of random CartPole steps; `seed` sets its initial weights."""
    tf.random.set_seed(seed)
    env = tf_py_environment.TFPyEnvironment(suite_gym.load("CartPole-v0"))
    train_step = tf.Variable(0, dtype=tf.int64, name="train_step")
    net = q_network.QNetwork(env.observation_spec(), env.action_spec(), fc_layer_params=hidden)
    agent = dqn_agent.DqnAgent(
        env.time_step_spec(), env.action_spec(), q_network=net,
        optimizer=tf.keras.optimizers.Adam(1e-2),
        td_errors_loss_fn=common.element_wise_squared_loss, train_step_counter=train_step,
    )  # fmt: skip
    buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(agent.collect_data_spec, env.batch_size, max_length=1000)
    random = random_tf_policy.RandomTFPolicy(env.time_step_spec(), env.action_spec())
    dynamic_step_driver.DynamicStepDriver(env, random, [buffer.add_batch], num_steps=COLLECT_STEPS).run()
    return Trainer(agent, train_step, lambda: buffer.as_dataset(sample_batch_size=BATCH, num_steps=2))
