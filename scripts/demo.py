"""The main job: a DQN CartPole trainer preempted and resumed through checkpointd.

Local mode (default): starts `checkpointd serve` on a local root, starts a
TF-Agents DQN trainer (scripts/cartpole_demo/trainer.py) that saves its whole
state (agent, replay buffer, train step, metrics) with `RemoteCheckpointer` and
its policies with `RemotePolicySavedModelTrigger`, preempts it part way with
SIGTERM (the notice Kubernetes and spot VMs give: the trainer saves the step it
reached and exits), starts a new trainer that resumes from the daemon at that
step (0 steps lost) and finishes, then prints what happened from the daemon's
own /metrics and the newest policy's CartPole return.

Fleet mode (`--fleet`, needs root for Ceph's packages): a local radosgw
(scripts/rgw.sh), two daemons on one s3:// root, the trainer on daemon A;
A and the trainer SIGKILLed together; a new trainer on daemon B, which takes
the run when A's lease expires and restores it; then `checkpointd status
--stored` and `checkpointd verify s3://...`.

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

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


# The trainer's own log line when its save on notice is durable (checkpointd_client.notice).
_SAVED_ON_NOTICE = r"run (\S+)\.train: preempted at step (\d+): saved, durable in (\d+) ms"
# From SIGTERM to the trainer's exit: its save on notice waits at most 25 s (notice_deadline).
_NOTICE_SECONDS = 60.0


def _preempt_with_notice(trainer: procs.Trainer) -> int:
    """SIGTERMs the trainer, waits for it to exit; returns the step its save on notice made durable."""
    print(
        f"preempted: SIGTERM to trainer 1 at step {trainer.step} (a notice, as Kubernetes or a spot VM gives)",
        flush=True,
    )
    code = trainer.notice(_NOTICE_SECONDS)
    saved = trainer.logged(_SAVED_ON_NOTICE)
    if saved is None:
        raise procs.DemoError(f"trainer 1 exited ({code}) without a save on notice; see {trainer.log}")
    reached = int(saved[2])
    if reached < trainer.step:
        raise procs.DemoError(f"trainer 1 saved step {reached} on notice, after it said step {trainer.step}")
    how = "ended by the SIGTERM" if code == -signal.SIGTERM else f"exited ({code})"
    print(f'trainer 1 logged "{saved[0]}", then {how}')
    return reached


def preempt_and_resume(
    args: argparse.Namespace,
    first: procs.Daemon,
    second: procs.Daemon,
    logs: Path,
    cleanup: list[Callable[[], object]],
    evaluate: Path | None = None,
    notice: bool = False,
) -> tuple[procs.Trainer, int, int]:
    """Trains on `first`, preempts the trainer, resumes on `second`.

    With `notice` the trainer gets SIGTERM and saves the step it reached
    before it exits; without, it is SIGKILLed (and `first` too if it is not
    `second`: a node lost), losing what it did since its last save.

    Returns:
        The finished second trainer, the step the first reached, and the step the second resumed at.
    """
    common = ["--run", args.run, "--steps", str(args.steps), "--save-every", str(args.save_every)]
    trainer = procs.Trainer.start(["--address", first.address, *common], logs / "trainer-1.log")
    cleanup.append(trainer.kill)
    trainer.wait_for("restored")
    print(f"trainer 1 (pid {trainer.proc.pid}): training on daemon {first.name} toward step {args.steps}")
    trainer.wait_for("step", lambda t: t.step >= args.kill_at and bool(t.saved))
    if notice:
        reached = _preempt_with_notice(trainer)
    else:
        trainer.kill()
        if first is not second:
            first.kill()
        reached = trainer.step
        nodes = f" and daemon {first.name} (pid {first.proc.pid})" if first is not second else ""
        print(f"preempted: SIGKILLed trainer 1 at step {trainer.step}{nodes}")
    killed = time.monotonic()

    if first is not second:
        print(f"trainer 2 starting on daemon {second.name}, which takes the run once A's lease expires ...", flush=True)
    extra = ["--evaluate", str(evaluate)] if evaluate is not None else []
    resumed = procs.Trainer.start(["--address", second.address, *common, *extra], logs / "trainer-2.log")
    cleanup.append(resumed.kill)
    step, restore_seconds, process_seconds = resumed.wait_for("restored")
    took = time.monotonic() - killed
    print(
        f"trainer 2 (pid {resumed.proc.pid}) on daemon {second.name}: resumed at step {step}, "
        f"{reached - int(step)} steps lost; {took:.1f} s from {'its exit' if notice else 'the kill'} to restored "
        f"(process start {float(process_seconds) - float(restore_seconds):.1f} s, "
        f"restore from the daemon {float(restore_seconds):.2f} s)"
    )
    (done,) = resumed.wait_for("done")
    print(f"trainer 2: finished at step {done}, every save durable")
    return resumed, reached, int(step)


def _print_metrics(daemon: procs.Daemon) -> None:
    m = procs.scrape(daemon.metrics_url)
    print(
        f"daemon {daemon.name}'s {daemon.metrics_url}: {m['accepted']:.0f} saves accepted, {m['skipped']:.0f} skipped, "
        f"{m['written']:.0f} written ({m['written_bytes'] / (1 << 20):,.1f} MiB), {m['failed']:.0f} failed; "
        f"saves on notice: {m['notice_ok']:.0f} ok, {m['notice_failed']:.0f} failed, "
        f"{m['notice_cancelled']:.0f} cancelled"
    )


def run_local(args: argparse.Namespace, cleanup: list[Callable[[], object]]) -> int:
    root = args.root.resolve()
    base = root.parent
    shutil.rmtree(root / args.run, ignore_errors=True)  # a fresh run each time, not a resume of the last demo's
    daemon = procs.start_daemon("A", ["--root", str(root)], base / "daemon")
    cleanup.append(daemon.stop)
    print(
        f"daemon A (pid {daemon.proc.pid}): gRPC {daemon.address}, metrics {daemon.metrics_url}, root {procs.shown(root)}"
    )
    resumed, _, _ = preempt_and_resume(args, daemon, daemon, base / "logs", cleanup, evaluate=root, notice=True)
    score, checkpoint = resumed.wait_for("return")
    resumed.proc.wait(60)
    _print_metrics(daemon)
    print(f"newest policy ({procs.shown(Path(checkpoint))}): CartPole return {score}")
    code = daemon.stop()
    print(f"daemon A stopped (exit {code})")
    print(
        f"on disk: training checkpoints {procs.shown(root / args.run / 'train')}, "
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
        help="the step at which to preempt the trainer: SIGTERM locally, SIGKILL in --fleet (default: 55%% of --steps)",
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
        code = run_fleet(args, cleanup, preempt_and_resume) if args.fleet else run_local(args, cleanup)
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
