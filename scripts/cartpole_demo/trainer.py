"""The demo's trainer: TF-Agents DQN on CartPole, its whole state saved through checkpointd.

One process of a training job that may be killed at any step. It builds the
agent, a `TFUniformReplayBuffer` and two metrics, then constructs a
`RemoteCheckpointer` (which restores the run's newest committed checkpoint
from the daemon, as `common.Checkpointer` restores from its dir) and a
`RemotePolicySavedModelTrigger`, and trains up to `--steps`, saving the
training state every `--save-every` steps without waiting for the disk.

On SIGTERM (a preemption announced) the `RemoteCheckpointer` saves the step
reached before the process ends (its default, `save_on_notice=True`) and logs
"run R: preempted at step N: saved, durable in X ms"; the trainer's log goes
to stderr, which the demo keeps in a file.

With `--continuous` it calls `save()` after every step instead of every
`--save-every` steps, on a `RemoteCheckpointer(continuous=True)`: each call
decides locally whether it saves, within a budget of training time (5 %), so
a SIGKILL, which gives no notice, loses only the steps since the newest save.

It talks to the demo on stdout in lines starting with `@` (the demo reads
them; TensorFlow's own output goes to stderr too):
`@restored STEP SECONDS`, `@step STEP SECONDS` (seconds since the process started),
`@saved STEP accepted|skipped`,
`@done STEP`, and with `--evaluate`, `@return RETURN CHECKPOINT`.

Usage: python scripts/cartpole_demo/trainer.py --address HOST:PORT --run RUN --steps N [--continuous]
       [--evaluate ROOT]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_STARTED = time.monotonic()


def _say(*parts: object) -> None:
    print("@" + " ".join(str(p) for p in parts), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--steps", type=int, required=True, help="train until the train step reaches this")
    parser.add_argument("--save-every", type=int, default=1000)
    parser.add_argument("--max-to-keep", type=int, default=20)
    parser.add_argument("--continuous", action="store_true", help="save() after every step, within a 5 %% budget")
    parser.add_argument(
        "--evaluate", type=Path, help="the daemon's local root: play one episode with the newest policy"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import tensorflow as tf
    from tf_agents.agents.dqn import dqn_agent
    from tf_agents.drivers import dynamic_step_driver
    from tf_agents.environments import suite_gym, tf_py_environment
    from tf_agents.eval import metric_utils
    from tf_agents.metrics import tf_metrics
    from tf_agents.networks import q_network
    from tf_agents.replay_buffers import tf_uniform_replay_buffer
    from tf_agents.utils import common

    from checkpointd_client import RemoteCheckpointer, RemotePolicySavedModelTrigger

    env = tf_py_environment.TFPyEnvironment(suite_gym.load("CartPole-v0"))
    net = q_network.QNetwork(env.observation_spec(), env.action_spec(), fc_layer_params=(100,))
    train_step = tf.Variable(0, dtype=tf.int64, name="train_step")
    agent = dqn_agent.DqnAgent(
        env.time_step_spec(),
        env.action_spec(),
        q_network=net,
        optimizer=tf.keras.optimizers.Adam(1e-3),
        td_errors_loss_fn=common.element_wise_squared_loss,
        train_step_counter=train_step,
    )
    agent.initialize()
    buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(agent.collect_data_spec, env.batch_size, max_length=10000)
    train_metrics = [tf_metrics.NumberOfEpisodes(), tf_metrics.AverageReturnMetric()]
    driver = dynamic_step_driver.DynamicStepDriver(
        env, agent.collect_policy, [buffer.add_batch, *train_metrics], num_steps=1
    )

    # Before: common.Checkpointer(ckpt_dir=os.path.join(root_dir, "train"), max_to_keep=..., agent=..., ...)
    # The constructor restores the run's newest committed checkpoint from the daemon.
    restoring = time.monotonic()
    checkpointer = RemoteCheckpointer(
        "train",
        args.address,
        run=args.run,  # the job: its folder, and this checkpointer's run "<job>.train"
        max_to_keep=args.max_to_keep,
        agent=agent,
        replay_buffer=buffer,
        global_step=train_step,
        metrics=metric_utils.MetricsGroup(train_metrics, "train_metrics"),
        continuous=args.continuous,  # each save() decides locally whether it saves (5 % of training time)
    )
    restored = int(train_step.numpy())
    _say("restored", restored, f"{time.monotonic() - restoring:.2f}", f"{time.monotonic() - _STARTED:.2f}")

    # Before: triggers.PolicySavedModelTrigger(os.path.join(root_dir, "policies"), agent, train_step, interval=...)
    trigger = RemotePolicySavedModelTrigger(
        "policies", agent, train_step, interval=args.save_every, start=restored, address=args.address, run=args.run
    )
    collect = common.function(driver.run)
    if restored == 0:
        for _ in range(200):  # a first experience; a restored buffer already holds it
            collect()
    iterator = iter(buffer.as_dataset(num_parallel_calls=2, sample_batch_size=64, num_steps=2).prefetch(2))
    train = common.function(agent.train)

    step, last_saved = restored, restored
    while step < args.steps:
        collect()
        train(next(iterator)[0])
        step = int(train_step.numpy())
        trigger(step)  # the policies, every --save-every steps
        if args.continuous or step % args.save_every == 0:
            ticket = checkpointer.save(train_step)  # returns at once; the daemon writes
            if not ticket.skipped or not args.continuous:  # continuous: most calls decide not to save
                _say("saved", step, "skipped" if ticket.skipped else "accepted")
            if not ticket.skipped:  # skipped: the previous save was still in flight (or, continuous, the budget)
                last_saved = step
        _say("step", step, f"{time.monotonic() - _STARTED:.3f}")
    if last_saved != step:  # the last step's state, unless the loop's save of it was accepted
        checkpointer.save(train_step, blocking=True)
    trigger(step, force_trigger=True)  # blocks until durable
    trigger.close()
    checkpointer.close()  # flushes: every accepted save is durable
    _say("done", step)

    if args.evaluate is not None:
        from tf_agents.policies import policy_loader

        policies = args.evaluate / args.run / "policies"
        newest = max((policies / "checkpoints").glob("policy_checkpoint_*"))
        # As TF-Agents loads a trained policy: the greedy SavedModel, updated from a checkpoint.
        policy = policy_loader.load(str(policies / "greedy_policy"), str(newest))
        py_env = suite_gym.load("CartPole-v0")
        time_step, total = py_env.reset(), 0.0
        while not time_step.is_last():
            time_step = py_env.step(policy.action(time_step).action)
            total += float(time_step.reward)
        _say("return", f"{total:.0f}", newest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
