"""A change to the daemon, measured against the daemon of another revision: policy saves over gRPC, alternating.

`python -m bench.probes.daemon_ab --against REV [--size large] [--reps 10]`
starts two daemons on the same machine, one from this tree and one from
REV's `service/` (extracted with `git archive` into a temporary dir and put
first on the daemon's PYTHONPATH), builds the bench's agent of `--size`
once, and saves its policy to each over gRPC (a RemotePolicySaver per
daemon, shared memory off: a trainer on another host), alternating which
goes first, each save durable before the next; an in-process
`PolicySaver.save` + fsync of the same policy runs in each round as the
anchor. The first round is not counted. Each published save is deleted, so
every save sends the whole policy (no incremental base), as in section 3b.

Prints each round and the medians: call -> durable for this tree, for REV,
and the anchor. Only the daemon differs between the two: the trainer side is
this tree's for both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 600.0


def service_at(revision: str, into: Path) -> Path:
    """REV's `service/` extracted under `into`; the dir to put on PYTHONPATH."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "service"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "service"


def run(revision: str, size_name: str, reps: int, work: Path) -> dict[str, float]:
    from tf_agents.policies import policy_saver

    from bench import agents
    from bench.config import SIZES
    from bench.inprocess import fsync_tree
    from checkpointd_client import RemotePolicySaver
    from tests.integration.support.daemon import start_daemon

    old = service_at(revision, work)
    daemons = {
        "this tree": start_daemon(work / "root-new", work / "work-new"),
        revision: start_daemon(work / "root-old", work / "work-old", env={"PYTHONPATH": str(old)}),
    }
    try:
        agent = agents.build_agent(SIZES[size_name])
        savers = {
            name: RemotePolicySaver(
                agent.policy,
                d.address,
                run="ab",
                train_step=agent.train_step_counter,
                timeout=TIMEOUT,
                shared_memory=False,
            )  # fmt: skip
            for name, d in daemons.items()
        }
        for saver in savers.values():
            saver.save("registered", blocking=True)
        local = policy_saver.PolicySaver(agent.policy, train_step=agent.train_step_counter)
        anchor = "PolicySaver.save + fsync"
        seconds: dict[str, list[float]] = {name: [] for name in [*daemons, anchor]}
        for i in range(reps + 1):
            row: dict[str, float] = {}
            start = time.perf_counter()
            local.save(str(work / f"local-{i}"))
            fsync_tree(work / f"local-{i}")
            row[anchor] = time.perf_counter() - start
            shutil.rmtree(work / f"local-{i}")
            for name in list(savers) if i % 2 == 0 else list(savers)[::-1]:
                start = time.perf_counter()
                savers[name].save(f"s{i}").result(TIMEOUT)
                row[name] = time.perf_counter() - start
                shutil.rmtree(daemons[name].root / "ab" / f"s{i}", ignore_errors=True)
            if i == 0:
                continue  # the first round warms both
            for name, value in row.items():
                seconds[name].append(value)
            print(f"round {i}: " + ", ".join(f"{n} {v * 1e3:.0f} ms" for n, v in row.items()), flush=True)
        for saver in savers.values():
            saver.close()
    finally:
        for d in daemons.values():
            d.terminate()
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print("medians: " + ", ".join(f"{n} {v * 1e3:.0f} ms" for n, v in medians.items()))
    return medians


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.daemon_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--against", metavar="REV", required=True, help="the git revision whose daemon to compare")
    p.add_argument("--size", default="large", help="the bench's policy size: small, medium or large")
    p.add_argument("--reps", type=int, default=10, help="rounds counted (one more runs first, not counted)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="checkpointd-daemon-ab-"))
    try:
        run(args.against, args.size, args.reps, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
