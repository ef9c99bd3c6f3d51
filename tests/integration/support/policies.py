"""Small real TF-Agents policies for the integration tier."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from tf_agents.networks import actor_distribution_network, q_network, q_rnn_network
from tf_agents.policies import actor_policy, q_policy
from tf_agents.policies.tf_policy import TFPolicy
from tf_agents.specs import tensor_spec
from tf_agents.trajectories import time_step as ts

OBS_SPEC = tf.TensorSpec([4], tf.float32, name="observation")
DISCRETE = tensor_spec.BoundedTensorSpec([], tf.int32, 0, 2, name="action")
CONTINUOUS = tensor_spec.BoundedTensorSpec([2], tf.float32, -1.0, 1.0, name="action")
# What a loaded policy SavedModel offers: its functions, and the signatures among them.
FUNCTIONS = (
    "action",
    "get_initial_state",
    "get_train_step",
    "get_metadata",
    "distribution",
    "model_variables",
)
SIGNATURES = {"action", "get_initial_state", "get_train_step", "get_metadata"}


def time_step_spec() -> ts.TimeStep:
    return ts.time_step_spec(OBS_SPEC)


def q(hidden: tuple[int, ...] = (16,)) -> TFPolicy:
    """A DQN-style greedy QPolicy."""
    net = q_network.QNetwork(OBS_SPEC, DISCRETE, fc_layer_params=hidden)
    return q_policy.QPolicy(time_step_spec(), DISCRETE, q_network=net)


def actor() -> TFPolicy:
    """A stochastic ActorPolicy with a continuous action."""
    net = actor_distribution_network.ActorDistributionNetwork(OBS_SPEC, CONTINUOUS, fc_layer_params=(8,))
    return actor_policy.ActorPolicy(time_step_spec(), CONTINUOUS, actor_network=net)


def recurrent() -> TFPolicy:
    """A QPolicy over an LSTM: it has policy state to thread through `action`."""
    net = q_rnn_network.QRnnNetwork(OBS_SPEC, DISCRETE, lstm_size=(8,))
    return q_policy.QPolicy(time_step_spec(), DISCRETE, q_network=net)


def build(policy: TFPolicy) -> TFPolicy:
    """Creates the policy's variables by running it once."""
    step = time_steps(1)
    policy.action(step, policy.get_initial_state(1))
    return policy


def time_steps(batch: int, seed: int = 0) -> ts.TimeStep:
    rng = np.random.default_rng(seed)
    obs = tf.constant(rng.normal(size=(batch, 4)).astype(np.float32))
    return ts.restart(obs, batch_size=batch)


def perturb(policy: TFPolicy, seed: int) -> None:
    """Gives every variable new values, so each save is distinguishable."""
    rng = np.random.default_rng(seed)
    for v in policy.variables():
        v.assign(rng.normal(size=v.shape).astype(v.dtype.as_numpy_dtype))


def greedy(policy: TFPolicy) -> TFPolicy:
    """`policy` taking its distribution's mode, so two copies can be compared by action."""
    from tf_agents.policies import greedy_policy

    return greedy_policy.GreedyPolicy(policy)


def mid_steps(batch: int, seed: int = 0) -> ts.TimeStep:
    """Mid-episode time steps: a recurrent network keeps its state instead of resetting it."""
    rng = np.random.default_rng(seed)
    obs = tf.constant(rng.normal(size=(batch, 4)).astype(np.float32))
    return ts.transition(obs, reward=tf.zeros([batch]), discount=tf.ones([batch]))


def values(policy: TFPolicy) -> list[np.ndarray]:
    """Copies of every variable's value, in `policy.variables()` order."""
    return [v.numpy() for v in policy.variables()]


def restore(policy: TFPolicy, saved: list[np.ndarray]) -> None:
    """Assigns values taken by `values()` back."""
    for v, value in zip(policy.variables(), saved, strict=True):
        v.assign(value)


def assert_policy_functions(loaded: Any) -> None:
    """A `tf.saved_model.load`ed policy has every policy function and signature."""
    for name in FUNCTIONS:
        assert hasattr(loaded, name), name
    assert set(loaded.signatures) >= SIGNATURES
