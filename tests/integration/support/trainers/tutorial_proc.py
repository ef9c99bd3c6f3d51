"""TF-Agents' "Checkpointer and PolicySaver" tutorial, with both savers swapped for the remote ones.

Usage:
    python -m tests.integration.support.trainers.tutorial_proc train ADDRESS RUN OUT
    python -m tests.integration.support.trainers.tutorial_proc restore ADDRESS RUN OUT

The tutorial's code (docs/tutorials/10_checkpointer_policysaver_tutorial),
smaller (a 32-unit Q-network, a 2,000-step buffer, 5 iterations), where the
two lines that make savers read:

    train_checkpointer = common.Checkpointer(ckpt_dir=checkpoint_dir, max_to_keep=1, agent=agent,
        policy=agent.policy, replay_buffer=replay_buffer, global_step=global_step)
    tf_policy_saver = policy_saver.PolicySaver(agent.policy)

and now read as below. `train` trains, saves both, and writes what the
checkpoint must hold to `OUT/train.json`; `restore` is the tutorial's
"restore checkpoint" section in a new process: the same objects, restored,
then the saved policy loaded from the daemon's disk and run on an episode.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TIMEOUT = 120.0


def _objects(address: str, run: str) -> dict:
    import tensorflow as tf
    from tf_agents.agents.dqn import dqn_agent
    from tf_agents.drivers import dynamic_step_driver
    from tf_agents.environments import suite_gym, tf_py_environment
    from tf_agents.networks import q_network
    from tf_agents.replay_buffers import tf_uniform_replay_buffer
    from tf_agents.utils import common

    from checkpointd_client import RemoteCheckpointer, RemotePolicySaver

    train_py_env = suite_gym.load("CartPole-v1")
    train_env = tf_py_environment.TFPyEnvironment(train_py_env)
    q_net = q_network.QNetwork(train_env.observation_spec(), train_env.action_spec(), fc_layer_params=(32,))
    optimizer = tf.compat.v1.train.AdamOptimizer(learning_rate=1e-3)
    global_step = tf.compat.v1.train.get_or_create_global_step()
    agent = dqn_agent.DqnAgent(
        train_env.time_step_spec(),
        train_env.action_spec(),
        q_network=q_net,
        optimizer=optimizer,
        td_errors_loss_fn=common.element_wise_squared_loss,
        train_step_counter=global_step,
    )
    agent.initialize()
    replay_buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(
        data_spec=agent.collect_data_spec, batch_size=train_env.batch_size, max_length=2000
    )
    collect_driver = dynamic_step_driver.DynamicStepDriver(
        train_env, agent.collect_policy, observers=[replay_buffer.add_batch], num_steps=100
    )
    # The tutorial's two savers, swapped (one line each):
    train_checkpointer = RemoteCheckpointer(
        "checkpoint", address, run=run, max_to_keep=1, timeout=TIMEOUT,
        agent=agent, policy=agent.policy, replay_buffer=replay_buffer, global_step=global_step,
    )  # fmt: skip
    tf_policy_saver = RemotePolicySaver(agent.policy, address, run=f"{run}.policy", folder=run, timeout=TIMEOUT)
    return {
        "env": train_env,
        "agent": agent,
        "global_step": global_step,
        "replay_buffer": replay_buffer,
        "collect_driver": collect_driver,
        "train_checkpointer": train_checkpointer,
        "tf_policy_saver": tf_policy_saver,
    }


def _summary(o: dict) -> dict:
    import numpy as np

    frames = o["replay_buffer"].gather_all()
    return {
        "global_step": int(o["global_step"].numpy()),
        "frames": int(o["replay_buffer"].num_frames().numpy()),
        "observations": float(np.asarray(frames.observation, np.float64).sum()),
        "weights": [float(np.asarray(v.numpy(), np.float64).sum()) for v in o["agent"].policy.variables()],
    }


def train(address: str, run: str, out: Path) -> int:
    o = _objects(address, run)
    agent, collect_driver, replay_buffer = o["agent"], o["collect_driver"], o["replay_buffer"]
    collect_driver.run()  # initial data collection
    dataset = replay_buffer.as_dataset(num_parallel_calls=3, sample_batch_size=64, num_steps=2).prefetch(3)
    iterator = iter(dataset)

    def train_one_iteration() -> None:
        collect_driver.run()
        experience, unused_info = next(iterator)
        agent.train(experience)

    for _ in range(5):
        train_one_iteration()
    o["train_checkpointer"].save(o["global_step"])
    o["tf_policy_saver"].save("policy")
    o["train_checkpointer"].close()
    o["tf_policy_saver"].close()  # both flushed: durable before the summary is written
    (out / "train.json").write_text(json.dumps(_summary(o)))
    return 0


def restore(address: str, run: str, out: Path, root: Path) -> int:
    import numpy as np
    import tensorflow as tf
    from tf_agents.environments import suite_gym, tf_py_environment

    o = _objects(address, run)
    o["train_checkpointer"].initialize_or_restore()
    global_step = tf.compat.v1.train.get_global_step()
    summary = _summary(o)
    summary["global_step_from_graph"] = int(global_step.numpy())
    saved_policy = tf.saved_model.load(str(root / run / "policy"))
    eval_env = tf_py_environment.TFPyEnvironment(suite_gym.load("CartPole-v1"))
    time_step, steps = eval_env.reset(), 0
    while not time_step.is_last() and steps < 500:
        time_step = eval_env.step(saved_policy.action(time_step).action)
        steps += 1
    summary["episode_steps"] = steps
    summary["policy_train_step"] = int(np.asarray(saved_policy.get_train_step()))
    o["train_checkpointer"].close()
    o["tf_policy_saver"].close()
    (out / "restore.json").write_text(json.dumps(summary))
    return 0


def main(argv: list[str]) -> int:
    mode, address, run, out = argv[:4]
    if mode == "train":
        return train(address, run, Path(out))
    return restore(address, run, Path(out), Path(argv[4]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
