"""Sections 1, 2, 3 and 6 for one policy size, in a process of its own.

`python -m bench.worker --size large --reps 3 --workdir DIR --out FILE` builds
one DQN agent, starts its own `checkpointd serve`, measures, and writes its
part of the results as JSON. A process per size keeps TensorFlow's memory of
one size from weighing on the next.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SAVE_TIMEOUT = 600.0
# A save is requested at least this far apart in the training windows.
MIN_CADENCE = 0.1

_START = time.monotonic()


def progress(size: str, message: str) -> None:
    print(f"[{time.monotonic() - _START:6.1f}s] {size}: {message}", flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.worker", description=__doc__)
    parser.add_argument("--size", required=True)
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--window", type=float, required=True, help="seconds per training window")
    parser.add_argument("--min-steps", type=int, default=5)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tf_agents.policies import async_policy_saver, policy_saver

    from bench import agents, inprocess, memory, remote, training_speed
    from bench.config import SIZES
    from bench.stats import summarize
    from checkpointd_client import RemotePolicySaver
    from tests.integration.support.daemon import start_daemon

    size = SIZES[args.size]
    say = lambda message: progress(size.name, message)  # noqa: E731
    work = args.workdir / size.name
    out = work / "inprocess"
    out.mkdir(parents=True, exist_ok=True)
    daemon = start_daemon(work / "daemon-root", work / "daemon-work")
    result: dict[str, Any] = {"daemon_log": str(daemon.log_path)}
    try:
        say(f"building a DQN agent of {size.params:,} parameters")
        agent = agents.build_agent(size)
        policy, counter = agent.policy, agent.train_step_counter
        payload = sum(v.dtype.size * int(v.shape.num_elements()) for v in policy.variables())
        payload += counter.dtype.size
        result["size"] = {"params": size.params, "hidden": list(size.hidden), "payload_bytes": payload}

        say("6. daemon memory (fresh daemon)")
        tiny = agents.build_agent(SIZES["small"], seed=1)
        with (
            RemotePolicySaver(tiny.policy, daemon.address, run="warmup") as warmup,
            RemotePolicySaver(
                policy, daemon.address, run="memory", train_step=counter, timeout=SAVE_TIMEOUT
            ) as mem_saver,
        ):
            result["memory"] = memory.daemon_memory(
                mem_saver,
                warmup,
                daemon.proc.pid,
                daemon.root / "memory",
                payload,
                args.reps,
                SAVE_TIMEOUT,
            )
        # Over gRPC too (a trainer on another host), once the shared-memory run is closed.
        with RemotePolicySaver(
            policy, daemon.address, run="memory-grpc", train_step=counter, timeout=SAVE_TIMEOUT, shared_memory=False
        ) as grpc_saver:
            result["memory"]["grpc"] = memory.grpc_peaks(
                grpc_saver, daemon.proc.pid, daemon.root / "memory-grpc", args.reps
            )
        del tiny

        say("1. in-process PolicySaver")
        saver = policy_saver.PolicySaver(policy, train_step=counter)
        result["inprocess"] = inprocess.policy_saver_times(saver, out, args.reps)

        say("2. AsyncPolicySaver and TF async checkpoint")
        checkpoint = inprocess.tf_checkpoint(saver)
        result["async"] = {
            "async_policy_saver": inprocess.async_policy_saver_times(saver, out, args.reps),
            "tf_async_checkpoint": inprocess.tf_async_checkpoint_times(checkpoint, out, args.reps),
        }

        say("3. checkpointd stall and latency")
        remote_saver = RemotePolicySaver(
            policy, daemon.address, run="trainer", train_step=counter, timeout=SAVE_TIMEOUT
        )
        try:
            first = remote.first_save(remote_saver)
            result["remote"] = {"first_save_seconds": first}
            result["remote"].update(
                remote.checkpointd_times(
                    remote_saver,
                    daemon.root / "trainer",
                    daemon.metrics_url,
                    args.reps,
                    SAVE_TIMEOUT,
                )
            )

            if size.name == "small":
                say("3. the stall against TF async's, alternating")
                result["remote"]["stall_vs_tf_async"] = remote.paired_stalls(
                    remote_saver, checkpoint, daemon.root / "trainer", out, SAVE_TIMEOUT
                )

            say("3. checkpointd over gRPC (shared memory off, as for a trainer on another host)")
            with RemotePolicySaver(
                policy, daemon.address, run="trainer-wire", train_step=counter,
                timeout=SAVE_TIMEOUT, shared_memory=False,
            ) as wire_saver:  # fmt: skip
                result["remote_wire"] = remote.first_save_parts(wire_saver)
                result["remote_wire"].update(
                    remote.checkpointd_times(
                        wire_saver,
                        daemon.root / "trainer-wire",
                        daemon.metrics_url,
                        args.reps,
                        SAVE_TIMEOUT,
                    )
                )
                say("3. over gRPC, alternating with PolicySaver.save + fsync")
                result["remote_wire"]["paired"] = remote.paired_wire(
                    wire_saver, saver, daemon.root / "trainer-wire", out, SAVE_TIMEOUT
                )

            cadence = max(MIN_CADENCE, result["inprocess"]["save"]["median"])
            say(f"2+3. DQN training windows, a save requested every {cadence:.3f} s")
            trainer = agents.Trainer(agent)
            asaver = async_policy_saver.AsyncPolicySaver(saver)
            try:
                drivers = [
                    training_speed.AsyncPolicySaverDriver(asaver, out),
                    training_speed.TfAsyncCheckpointDriver(checkpoint, inprocess.ASYNC, out),
                    training_speed.CheckpointdDriver(remote_saver, daemon.root / "trainer", "window", SAVE_TIMEOUT),
                ]
                windows = training_speed.interleaved_windows(
                    trainer, drivers, args.reps, args.window, args.min_steps, cadence, say
                )
            finally:
                asaver.close()
        finally:
            remote_saver.close(SAVE_TIMEOUT)
        result["training"] = {
            "cadence_seconds": cadence,
            "window_seconds": args.window,
            "steps_per_second": {k: summarize(w.steps_per_second for w in ws) for k, ws in windows.items()},
            "steps": {k: [w.steps for w in ws] for k, ws in windows.items()},
            # Share of each window the loop spent inside save calls (the stalls).
            "request_share": {
                k: summarize(w.request_seconds / w.seconds for w in ws) for k, ws in windows.items() if k != "baseline"
            },
            "saves": {
                k: {c: sum(w.counts[c] for w in ws) for c in ws[0].counts}
                for k, ws in windows.items()
                if k != "baseline"
            },
        }
    finally:
        code = daemon.terminate()
        result["daemon_exit_code"] = code
    say("done")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
