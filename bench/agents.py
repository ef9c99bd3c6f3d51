"""The DQN agents the benchmark saves and trains: TF-Agents' own, nothing mocked.

Imports TensorFlow; only worker processes import this module.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tf_agents.agents.dqn import dqn_agent
from tf_agents.networks import q_network
from tf_agents.specs import tensor_spec
from tf_agents.trajectories import time_step as ts
from tf_agents.trajectories import trajectory
from tf_agents.utils import common

from bench.config import NUM_ACTIONS, OBS_DIM, TRAIN_BATCH, TRAIN_STEPS_PER_SAMPLE, Size

OBS_SPEC = tf.TensorSpec([OBS_DIM], tf.float32, name="observation")
ACTION_SPEC = tensor_spec.BoundedTensorSpec([], tf.int32, 0, NUM_ACTIONS - 1, name="action")


def build_agent(size: Size, seed: int = 0) -> dqn_agent.DqnAgent:
    """A DqnAgent over a QNetwork of `size`, initialized, with an int64 step counter.

    Raises:
        AssertionError: if the network's parameter count is not `size.params`.
    """
    tf.random.set_seed(seed)
    net = q_network.QNetwork(OBS_SPEC, ACTION_SPEC, fc_layer_params=size.hidden)
    agent = dqn_agent.DqnAgent(
        ts.time_step_spec(OBS_SPEC),
        ACTION_SPEC,
        q_network=net,
        optimizer=tf.keras.optimizers.Adam(1e-4),
        train_step_counter=tf.Variable(0, dtype=tf.int64, name="train_step"),
    )
    agent.initialize()
    params = sum(int(np.prod(v.shape)) for v in agent.policy.variables())
    assert params == size.params, (size, params)
    return agent


def experience(seed: int = 0) -> trajectory.Trajectory:
    """One fixed batch of transitions, [TRAIN_BATCH, TRAIN_STEPS_PER_SAMPLE]."""
    rng = np.random.default_rng(seed)
    shape = (TRAIN_BATCH, TRAIN_STEPS_PER_SAMPLE)
    return trajectory.Trajectory(
        step_type=tf.constant(np.ones(shape, np.int32)),
        observation=tf.constant(rng.normal(size=(*shape, OBS_DIM)).astype(np.float32)),
        action=tf.constant(rng.integers(0, NUM_ACTIONS, size=shape).astype(np.int32)),
        policy_info=(),
        next_step_type=tf.constant(np.ones(shape, np.int32)),
        reward=tf.constant(rng.normal(size=shape).astype(np.float32)),
        discount=tf.constant(np.ones(shape, np.float32)),
    )


class Trainer:
    """`agent.train` as a tf.function over a fixed batch; `step()` returns once it ran."""

    def __init__(self, agent: dqn_agent.DqnAgent) -> None:
        self._train = common.function(agent.train)
        self._experience = experience()
        self.step()  # traces

    def step(self) -> float:
        # .numpy() waits for the step, so a loop of steps measures real work.
        return float(self._train(self._experience).loss.numpy())
