"""A small but complete TF-Agents training state for checkpoint tests.

A DQN agent with Adam on CartPole, a TFUniformReplayBuffer filled by a
driver, the global step, a TF metric and a py metric (NumpyState inside), as
the "Checkpointer and PolicySaver" tutorial and the DQN train_eval example
checkpoint them. `values()` reads what a checkpoint of them holds, key by key,
through TensorFlow's own saver (bit for bit, Python state included), so
tests compare whole states without listing variables by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf
from tf_agents.agents.dqn import dqn_agent
from tf_agents.drivers import dynamic_step_driver
from tf_agents.environments import suite_gym, tf_py_environment
from tf_agents.metrics import py_metrics, tf_metrics
from tf_agents.networks import q_network
from tf_agents.policies import random_tf_policy
from tf_agents.replay_buffers import tf_uniform_replay_buffer
from tf_agents.specs import tensor_spec
from tf_agents.trajectories import trajectory
from tf_agents.utils import common

from checkpointd_client import tf_checkpoint as training

BUFFER_LENGTH = 500
BATCH = 16


@dataclass
class State:
    """The objects of one trainer, and what drives them."""

    env: tf_py_environment.TFPyEnvironment
    agent: dqn_agent.DqnAgent
    global_step: tf.Variable
    replay_buffer: tf_uniform_replay_buffer.TFUniformReplayBuffer
    tf_metric: tf_metrics.AverageReturnMetric
    py_metric: py_metrics.AverageReturnMetric
    collect_driver: dynamic_step_driver.DynamicStepDriver

    @property
    def objects(self) -> dict[str, Any]:
        """What the tests checkpoint: the tutorial's objects plus both kinds of metric."""
        return {
            "agent": self.agent,
            "policy": self.agent.policy,
            "replay_buffer": self.replay_buffer,
            "global_step": self.global_step,
            "tf_metric": self.tf_metric,
            "py_metric": self.py_metric,
        }

    def collect(self, steps: int) -> None:
        """Runs the collect policy `steps` env steps into the buffer and both metrics."""
        for _ in range(steps):
            time_step, _ = self.collect_driver.run(maximum_iterations=1)
            del time_step

    def train(self, steps: int) -> float:
        """`steps` DQN updates from the buffer; returns the last loss."""
        dataset = self.replay_buffer.as_dataset(sample_batch_size=BATCH, num_steps=2, single_deterministic_pass=False)
        iterator = iter(dataset)
        loss = 0.0
        for _ in range(steps):
            experience, _ = next(iterator)
            loss = float(self.agent.train(experience).loss)
        return loss

    def create_optimizer_variables(self) -> None:
        """Creates Adam's slots without training, as tf_agents.train.Learner does before restoring.

        A restore into an optimizer that has not built its slots yet defers
        them until it does (TensorFlow restores them as they are created);
        building them first makes the restore assign them at once.
        """
        specs = tensor_spec.add_outer_dims_nest(self.agent.training_data_spec, (None, self.agent.train_sequence_length))
        common.function(self.agent.train).get_concrete_function(specs)


def build(seed: int = 0, hidden: tuple[int, ...] = (16,)) -> State:
    """A fresh trainer; `seed` sets its initial weights and the collect policy's randomness."""
    tf.random.set_seed(seed)
    np.random.seed(seed)
    env = tf_py_environment.TFPyEnvironment(suite_gym.load("CartPole-v0"))
    env.pyenv.envs[0].seed(seed)
    global_step = tf.Variable(0, dtype=tf.int64, name="global_step")
    net = q_network.QNetwork(env.observation_spec(), env.action_spec(), fc_layer_params=hidden)
    agent = dqn_agent.DqnAgent(
        env.time_step_spec(),
        env.action_spec(),
        q_network=net,
        optimizer=tf.keras.optimizers.Adam(1e-2),
        td_errors_loss_fn=common.element_wise_squared_loss,
        train_step_counter=global_step,
        target_update_period=5,
    )
    agent.initialize()
    buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(
        agent.collect_data_spec, env.batch_size, max_length=BUFFER_LENGTH
    )
    tf_metric = tf_metrics.AverageReturnMetric()
    py_metric = py_metrics.AverageReturnMetric(buffer_size=8)

    def observe_py(traj: trajectory.Trajectory) -> tf.Operation:
        # The py metric sees the same steps, unbatched, as a PyDriver would show it.
        def call(*flat: Any) -> np.int32:
            py_metric(tf.nest.pack_sequence_as(traj, [np.asarray(x)[0] for x in flat]))
            return np.int32(0)

        return tf.numpy_function(call, tf.nest.flatten(traj), tf.int32)

    random = random_tf_policy.RandomTFPolicy(env.time_step_spec(), env.action_spec())
    driver = dynamic_step_driver.DynamicStepDriver(
        env, random, observers=[buffer.add_batch, tf_metric, observe_py], num_steps=1
    )
    return State(env, agent, global_step, buffer, tf_metric, py_metric, driver)


def values(objects: dict[str, Any]) -> dict[str, bytes]:
    """Checkpoint key -> the bytes TensorFlow's saver would write for it now (save_counter aside)."""
    root = tf.train.Checkpoint(**objects)
    state = training.describe(root)
    return {
        t.checkpoint_key: bytes(part)
        for t, part in zip(state.tensors, state.copy(), strict=True)
        if not t.checkpoint_key.startswith("save_counter/")
    }
