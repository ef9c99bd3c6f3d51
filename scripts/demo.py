"""The main job: a DQN CartPole trainer saving through a local checkpointd.

Starts `checkpointd serve` on a local root, trains a real TF-Agents DqnAgent on
CartPole, saves the greedy policy through RemotePolicySaver every N steps
(non-blocking: the trainer never waits for disk), flushes and closes, stops
the daemon with SIGTERM, then loads the newest SavedModel and runs it.
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
        [sys.executable, "-m", "checkpointd", "serve", "--root", str(root),
         "--port", "0", "--port-file", str(port_file),
         "--metrics-port", "0", "--metrics-port-file", str(metrics_file)],
        stdout=log, stderr=subprocess.STDOUT,
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
    parser.add_argument("--steps", type=int, default=2000, help="training iterations")
    parser.add_argument("--save-every", type=int, default=250)
    parser.add_argument("--run", default="cartpole-dqn")
    args = parser.parse_args()

    import tensorflow as tf
    from tf_agents.agents.dqn import dqn_agent
    from tf_agents.drivers import dynamic_step_driver
    from tf_agents.environments import suite_gym, tf_py_environment
    from tf_agents.networks import q_network
    from tf_agents.replay_buffers import tf_uniform_replay_buffer
    from tf_agents.utils import common

    from checkpointd_client import RemotePolicySaver

    root = args.root.resolve()
    daemon, address, metrics_port = _start_daemon(root, root.parent / "daemon")
    print(f"checkpointd: pid {daemon.pid}, gRPC {address}, metrics http://127.0.0.1:{metrics_port}/metrics, root {root}")
    try:
        env = tf_py_environment.TFPyEnvironment(suite_gym.load("CartPole-v0"))
        net = q_network.QNetwork(env.observation_spec(), env.action_spec(), fc_layer_params=(100,))
        train_step = tf.Variable(0, dtype=tf.int64, name="train_step")
        agent = dqn_agent.DqnAgent(
            env.time_step_spec(), env.action_spec(), q_network=net,
            optimizer=tf.keras.optimizers.Adam(1e-3),
            td_errors_loss_fn=common.element_wise_squared_loss, train_step_counter=train_step,
        )
        agent.initialize()
        buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(agent.collect_data_spec, env.batch_size, max_length=10000)
        driver = dynamic_step_driver.DynamicStepDriver(env, agent.collect_policy, [buffer.add_batch], num_steps=1)
        driver.run()
        dataset = buffer.as_dataset(num_parallel_calls=2, sample_batch_size=64, num_steps=2).prefetch(2)
        iterator = iter(dataset)
        train = common.function(agent.train)
        collect = common.function(driver.run)
        for _ in range(200):
            collect()

        # The one-line swap: AsyncPolicySaver(PolicySaver(policy, ...)) ->
        saver = RemotePolicySaver(agent.policy, address, run=args.run, train_step=train_step)
        tickets = []
        started = time.monotonic()
        with saver:
            for _ in range(args.steps):
                collect()
                loss = train(next(iterator)[0]).loss
                step = int(train_step.numpy())
                if step % args.save_every == 0:
                    ticket = saver.save(f"policy_{step:08d}")
                    tickets.append(ticket)
                    print(f"step {step}: loss {float(loss):.3f}, save {'skipped' if ticket.skipped else 'accepted'}")
            saver.save(f"policy_{int(train_step.numpy()):08d}", blocking=True)
        # Leaving the `with` flushed and closed the run: every accepted save is durable.
        elapsed = time.monotonic() - started
        accepted = [t for t in tickets if not t.skipped]
        print(f"trained {args.steps} steps in {elapsed:.1f}s; {len(accepted)} of {len(tickets)} periodic saves accepted")
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(60)
        print(f"checkpointd stopped (exit {code}); log: {root.parent / 'daemon' / 'daemon.log'}")

    newest = max((root / args.run).glob("policy_*"))
    policy = tf.saved_model.load(str(newest))
    eval_env = tf_py_environment.TFPyEnvironment(suite_gym.load("CartPole-v0"))
    time_step, total = eval_env.reset(), 0.0
    state = policy.get_initial_state(eval_env.batch_size)
    while not bool(time_step.is_last()[0]):
        step = policy.action(time_step, state)
        state = step.state
        time_step = eval_env.step(step.action)
        total += float(time_step.reward[0])
    print(f"newest SavedModel: {newest} (train step {int(policy.get_train_step())})")
    print(f"it ran one CartPole episode with return {total:.0f}")
    print(f"all saves: {sorted(p.name for p in (root / args.run).iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
