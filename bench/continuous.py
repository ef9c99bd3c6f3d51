"""Continuous saves: the demo's DQN CartPole trainer with `save()` after every step, against no saves.

`python -m bench.continuous --reps 5 --window 10 --workdir DIR`
builds the demo's trainer (`scripts/cartpole_demo/trainer.py`: a QNetwork of
100 units, Adam, a TFUniformReplayBuffer of 10,000 steps, two metrics; one
collect step and one train step per iteration), starts its own
`checkpointd serve` on this host, and times windows of training, interleaved
so the machine's drift falls on both alike: one with no saves, then one
calling `RemoteCheckpointer(continuous=True).save(train_step)` after every
step. It prints each window's steps/s, the medians, the median of the
rounds' ratios (each round's two windows side by side), the
checkpointer's decisions and the mean time of a call that did not save
(with `--out FILE`, as JSON too: `python -m bench` runs it in its preemption
section, bench/preemption.py judges it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def paired_ratio(rates: dict[str, list[float]]) -> float:
    """The median over rounds of (continuous ÷ no saves) steps/s, each round's two windows side by side: the
    machine's drift between rounds (other work, the trainer's own warming) falls out of each round's ratio."""
    return statistics.median(c / n for n, c in zip(rates["none"], rates["continuous"], strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="rounds of (no saves, continuous saves)")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of training per window")
    parser.add_argument("--budget", type=float, default=0.05)
    parser.add_argument("--workdir", type=Path, help="where the daemon writes (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="also write the figures here, as JSON")
    args = parser.parse_args(argv)

    import tensorflow as tf
    from tf_agents.agents.dqn import dqn_agent
    from tf_agents.drivers import dynamic_step_driver
    from tf_agents.environments import suite_gym, tf_py_environment
    from tf_agents.eval import metric_utils
    from tf_agents.metrics import tf_metrics
    from tf_agents.networks import q_network
    from tf_agents.replay_buffers import tf_uniform_replay_buffer
    from tf_agents.utils import common

    from checkpointd_client import RemoteCheckpointer
    from checkpointd_client.continuous import HANDED_OVER_REASON
    from tests.integration.support.daemon import start_daemon

    env = tf_py_environment.TFPyEnvironment(suite_gym.load("CartPole-v0"))
    net = q_network.QNetwork(env.observation_spec(), env.action_spec(), fc_layer_params=(100,))
    train_step = tf.Variable(0, dtype=tf.int64, name="train_step")
    agent = dqn_agent.DqnAgent(
        env.time_step_spec(), env.action_spec(), q_network=net, optimizer=tf.keras.optimizers.Adam(1e-3),
        td_errors_loss_fn=common.element_wise_squared_loss, train_step_counter=train_step,
    )  # fmt: skip
    agent.initialize()
    buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(agent.collect_data_spec, env.batch_size, max_length=10000)
    metrics = [tf_metrics.NumberOfEpisodes(), tf_metrics.AverageReturnMetric()]
    driver = dynamic_step_driver.DynamicStepDriver(env, agent.collect_policy, [buffer.add_batch, *metrics], num_steps=1)
    collect = common.function(driver.run)
    for _ in range(200):
        collect()
    iterator = iter(buffer.as_dataset(num_parallel_calls=2, sample_batch_size=64, num_steps=2).prefetch(2))
    train = common.function(agent.train)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-continuous-"))
    daemon = start_daemon(workdir / "root", workdir / "work")
    try:
        checkpointer = RemoteCheckpointer(
            "train", daemon.address, run="bench-continuous", continuous=True, budget=args.budget, timeout=120.0,
            agent=agent, replay_buffer=buffer, global_step=train_step,
            metrics=metric_utils.MetricsGroup(metrics, "train_metrics"),
        )  # fmt: skip

        def window(saving: bool) -> tuple[float, float, int, float]:
            """Steps/s of one window; with `saving`, the seconds in calls that did not save, their count, and
            the share of the window spent in save()."""
            steps, skipped_seconds, skipped, in_save = 0, 0.0, 0, 0.0
            start = time.perf_counter()
            while True:
                collect()
                train(next(iterator)[0])
                steps += 1
                if saving:
                    entered = time.perf_counter()
                    ticket = checkpointer.save(train_step)
                    took = time.perf_counter() - entered
                    in_save += took
                    if ticket.skipped and ticket.reason != HANDED_OVER_REASON:  # a hand-over copies: not a skip
                        skipped_seconds += took
                        skipped += 1
                elapsed = time.perf_counter() - start
                if elapsed >= args.window:
                    return steps / elapsed, skipped_seconds, skipped, in_save / elapsed

        window(False)  # warm-up: traces, the first save's description of the graph
        window(True)
        before = checkpointer.decisions
        rates: dict[str, list[float]] = {"none": [], "continuous": []}
        skip_seconds, skips, shares = 0.0, 0, []
        for rep in range(args.reps):
            rates["none"].append(window(False)[0])
            rate, seconds, count, share = window(True)
            rates["continuous"].append(rate)
            skip_seconds, skips = skip_seconds + seconds, skips + count
            shares.append(share)
            print(f"round {rep + 1}/{args.reps}: no saves {rates['none'][-1]:.1f} steps/s, "
                  f"save() every step {rate:.1f} steps/s ({share * 100:.1f} % of the window in save())",
                  flush=True)  # fmt: skip
        after = checkpointer.decisions
        checkpointer.close()
        assert before is not None and after is not None
        none, continuous = statistics.median(rates["none"]), statistics.median(rates["continuous"])
        ratio = paired_ratio(rates)
        saved = after.saved - before.saved
        calls = after.calls - before.calls
        print(f"median steps/s: no saves {none:.1f}, save() every step {continuous:.1f}; median of the "
              f"{args.reps} rounds' ratios {ratio:.3f} ({(1 - ratio) * 100:+.1f} % slower)")  # fmt: skip
        print(f"decisions over the measured windows: {calls} calls, {saved} saved "
              f"({saved / (args.reps * args.window):.1f}/s), "
              f"{after.skipped_by_budget - before.skipped_by_budget} skipped by the budget, "
              f"{after.skipped_busy - before.skipped_busy} skipped busy, "
              f"{after.handed_over - before.handed_over} handed over as standby snapshots; "
              f"a call that did not save: {skip_seconds / max(skips, 1) * 1e6:.0f} us mean")  # fmt: skip
        print(f"time in save(): {statistics.median(shares) * 100:.1f} % of the window (median; budget "
              f"{args.budget * 100:g} %); durable checkpoints: {checkpointer.counts}")  # fmt: skip
        if args.out is not None:
            args.out.write_text(json.dumps({
                "steps_per_second": {"none": none, "continuous": continuous, "samples": rates},
                "ratio": ratio, "ratio_of_medians": continuous / none, "budget": args.budget, "in_save_share": statistics.median(shares),
                "decisions": {k: getattr(after, k) - getattr(before, k) for k in dataclasses.asdict(after)},
            }, indent=1))  # fmt: skip
    finally:
        daemon.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
