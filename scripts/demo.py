"""The main job: a DQN CartPole trainer saving through a local checkpointd.

Starts `checkpointd serve` on a local root, trains a real TF-Agents DqnAgent on
CartPole and saves through RemotePolicySavedModelTrigger: the raw, collect and
greedy SavedModels at the start, then a non-blocking checkpoint every N steps
(the trainer never waits for disk). Closes the trigger (every save durable),
stops the daemon with SIGTERM, then loads the greedy SavedModel updated from
the newest checkpoint and runs one episode with it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _start_daemon(root: Path, work: Path) -> tuple[subprocess.Popen, str, str]:
    work.mkdir(parents=True, exist_ok=True)
    port_file, metrics_file = work / "port", work / "metrics-port"
    for f in (port_file, metrics_file):
        f.unlink(missing_ok=True)
    log = open(work / "daemon.log", "ab")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "checkpointd",
            "serve",
            "--root",
            str(root),
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--metrics-port",
            "0",
            "--metrics-port-file",
            str(metrics_file),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while not (port_file.exists() and metrics_file.exists()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"checkpointd did not start; see {work / 'daemon.log'}")
        time.sleep(0.1)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}", metrics_file.read_text().strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("demo/checkpoints"))
    parser.add_argument("--steps", type=int, default=10000, help="training iterations")
    parser.add_argument("--save-every", type=int, default=1000)
    parser.add_argument("--run", default="cartpole-dqn")
    args = parser.parse_args()

    import tensorflow as tf
    from tf_agents.agents.dqn import dqn_agent
    from tf_agents.drivers import dynamic_step_driver
    from tf_agents.environments import suite_gym, tf_py_environment
    from tf_agents.networks import q_network
    from tf_agents.policies import policy_loader
    from tf_agents.replay_buffers import tf_uniform_replay_buffer
    from tf_agents.utils import common

    from checkpointd_client import RemotePolicySavedModelTrigger

    root = args.root.resolve()
    daemon, address, metrics_port = _start_daemon(root, root.parent / "daemon")
    print(
        f"checkpointd: pid {daemon.pid}, gRPC {address}, metrics http://127.0.0.1:{metrics_port}/metrics, root {root}"
    )
    try:
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
        buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(
            agent.collect_data_spec, env.batch_size, max_length=10000
        )
        driver = dynamic_step_driver.DynamicStepDriver(env, agent.collect_policy, [buffer.add_batch], num_steps=1)
        driver.run()
        dataset = buffer.as_dataset(num_parallel_calls=2, sample_batch_size=64, num_steps=2).prefetch(2)
        iterator = iter(dataset)
        train = common.function(agent.train)
        collect = common.function(driver.run)
        for _ in range(200):
            collect()

        # The one-line swap: tf_agents.train.triggers.PolicySavedModelTrigger(
        #     os.path.join(root_dir, "policies"), agent, train_step, interval=...) ->
        trigger = RemotePolicySavedModelTrigger(
            "policies", agent, train_step, interval=args.save_every, address=address, run=args.run
        )
        started = time.monotonic()
        for _ in range(args.steps):
            collect()
            loss = train(next(iterator)[0]).loss
            step = int(train_step.numpy())
            trigger(step)  # every --save-every steps: a non-blocking checkpoint through the daemon
            if step % args.save_every == 0:
                ticket = trigger.last_ticket
                outcome = "skipped" if ticket is not None and ticket.skipped else "accepted"
                print(f"step {step}: loss {float(loss):.3f}, checkpoint {outcome}")
        trigger(int(train_step.numpy()), force_trigger=True)  # the final one blocks until durable
        trigger.close()  # flushes and closes the runs: every accepted save is durable
        print(f"trained {args.steps} steps in {time.monotonic() - started:.1f}s")
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(60)
        print(f"checkpointd stopped (exit {code}); log: {root.parent / 'daemon' / 'daemon.log'}")

    policies_dir = root / args.run / "policies"
    newest = max((policies_dir / "checkpoints").glob("policy_checkpoint_*"))
    # As TF-Agents loads a trained policy: the greedy SavedModel, updated from a checkpoint.
    policy = policy_loader.load(str(policies_dir / "greedy_policy"), str(newest))
    py_env = suite_gym.load("CartPole-v0")
    time_step, total = py_env.reset(), 0.0
    while not time_step.is_last():
        time_step = py_env.step(policy.action(time_step).action)
        total += float(time_step.reward)
    print(f"newest checkpoint: {newest} (train step {int(policy.get_train_step())})")
    print(f"greedy policy from {policies_dir / 'greedy_policy'} + that checkpoint: CartPole return {total:.0f}")
    print(f"saves: {sorted(p.name for p in (policies_dir / 'checkpoints').iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
