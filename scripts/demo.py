"""The main job: a DQN CartPole trainer preempted and resumed through checkpointd.

Local mode (default): starts `checkpointd serve` on a local root, starts a
TF-Agents DQN trainer (scripts/cartpole_demo/trainer.py) that saves its whole
state (agent, replay buffer, train step, metrics) with `RemoteCheckpointer` and
its policies with `RemotePolicySavedModelTrigger`, preempts it part way with
SIGTERM (the notice Kubernetes and spot VMs give: the trainer saves the step it
reached and exits), starts a new trainer that resumes from the daemon at that
step (0 steps lost) and finishes. Then a second job (run `<run>-continuous`)
whose trainer calls `save()` after every step (`continuous=True`: each call
decides locally whether it saves, within 5 % of training time) is SIGKILLed
part way, with no notice; its next trainer resumes from the newest continuous
save, and the demo prints the steps lost and the seconds of training they
were. Last, what happened from the daemon's own /metrics and the newest
policy's CartPole return.

Fleet mode (`--fleet`, needs root for Ceph's packages): a local radosgw
(scripts/rgw.sh), three daemons on one s3:// root, the trainer on daemon A;
node A drained (the trainer and A get SIGTERM: the trainer's save on notice
goes through A, which releases the run as it exits) and a new trainer on
daemon B takes the run at once, 0 steps lost; then node B lost (B and its
trainer SIGKILLed) and a third trainer on daemon C takes the run when B's
lease expires; then `checkpointd status --stored` and `checkpointd verify
s3://...`.

The demo does not import TensorFlow; the trainers do. Everything it starts is
stopped at the end, also on Ctrl-C. Exit 0 on success, 1 if a step failed,
3 if the fleet mode cannot install Ceph (not root).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from cartpole_demo import procs
from cartpole_demo.fleet import run_fleet
from cartpole_demo.preempt import Job

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # Once: Ctrl-C reaches the demo twice (the terminal's group signal, and demo.sh's trap passing it on),
    # and a second KeyboardInterrupt landing in the cleanup would leave the daemons and trainers running.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _print_metrics(daemon: procs.Daemon) -> None:
    m = procs.scrape(daemon.metrics_url)
    print(
        f"daemon {daemon.name}'s {daemon.metrics_url}: {m['accepted']:.0f} saves accepted, {m['skipped']:.0f} skipped, "
        f"{m['written']:.0f} written ({m['written_bytes'] / (1 << 20):,.1f} MiB), {m['failed']:.0f} failed; "
        f"saves on notice: {m['notice_ok']:.0f} ok, {m['notice_failed']:.0f} failed, "
        f"{m['notice_cancelled']:.0f} cancelled; standby snapshots of killed trainers written: "
        f"{m['standby_written']:.0f}"
    )


def run_local(args: argparse.Namespace, cleanup: list[Callable[[], object]]) -> int:
    root = args.root.resolve()
    base = root.parent
    continuous_run = f"{args.run}-continuous"
    for run in (args.run, continuous_run):
        shutil.rmtree(root / run, ignore_errors=True)  # a fresh run each time, not a resume of the last demo's
    daemon = procs.start_daemon("A", ["--root", str(root)], base / "daemon")
    cleanup.append(daemon.stop)
    print(
        f"daemon A (pid {daemon.proc.pid}): gRPC {daemon.address}, metrics {daemon.metrics_url}, root {procs.shown(root)}"
    )
    job = Job(args, base / "logs", cleanup)
    trainer = job.train(daemon)
    trainer.wait_for("step", lambda t: t.step >= args.kill_at and bool(t.saved))
    job.preempt(trainer, daemon, notice=True)
    resumed, _ = job.resume(daemon, ["--evaluate", str(root)])
    job.finish(resumed)
    score, checkpoint = resumed.wait_for("return")
    resumed.proc.wait(60)

    print(f"run {continuous_run}: save() after every step (continuous saves, 5 % budget), then a SIGKILL (no notice)")
    saving = Job(
        args, base / "logs", cleanup, run=continuous_run, trainer_args=["--continuous"], numbered_after=job.started
    )
    trainer = saving.train(daemon)
    trainer.wait_for("step", lambda t: t.step >= args.kill_at and bool(t.saved))
    saving.preempt(trainer, daemon, notice=False)
    resumed, _ = saving.resume(daemon)
    saving.finish(resumed)
    resumed.proc.wait(60)
    _print_metrics(daemon)
    print(f"newest policy ({procs.shown(Path(checkpoint))}): CartPole return {score}")
    code = daemon.stop()
    print(f"daemon A stopped (exit {code})")
    print(
        f"on disk: training checkpoints {procs.shown(root / args.run / 'train')} and "
        f"{procs.shown(root / continuous_run / 'train')}, "
        f"policies {procs.shown(root / args.run / 'policies')}, logs {procs.shown(base / 'logs')} and {procs.shown(daemon.log)}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", action="store_true", help="two daemons on a local S3 server (needs root)")
    parser.add_argument("--root", type=Path, default=Path("demo/checkpoints"), help="local mode's daemon root")
    parser.add_argument("--dir", type=Path, default=Path("demo/fleet"), help="fleet mode's working dir")
    parser.add_argument("--steps", type=int, default=10000, help="train steps in all")
    parser.add_argument("--save-every", type=int, default=1000, help="steps between checkpoints")
    parser.add_argument(
        "--kill-at",
        type=int,
        help="the step at which the trainer gets SIGTERM (with --fleet: node A drained; node B is lost halfway from "
        "there to --steps) (default: 55%% of --steps)",
    )
    parser.add_argument("--run", default="cartpole-dqn")
    parser.add_argument("--lease-seconds", type=float, default=5.0, help="fleet mode's run lease")
    args = parser.parse_args(argv)
    if args.kill_at is None:
        args.kill_at = args.steps * 11 // 20
    if not 0 < args.save_every <= args.kill_at < args.steps:
        parser.error("need 0 < --save-every <= --kill-at < --steps")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    cleanup: list[Callable[[], object]] = []
    started = time.monotonic()
    try:
        code = run_fleet(args, cleanup) if args.fleet else run_local(args, cleanup)
        print(f"demo done in {time.monotonic() - started:.0f} s")
        return code
    except procs.DemoError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"\ndemo interrupted ({e or 'SIGINT'}): stopping what it started", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cleanup runs to its end
        for stop in reversed(cleanup):
            try:
                stop()
            except (OSError, subprocess.SubprocessError) as e:
                print(f"demo: while stopping: {e}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
