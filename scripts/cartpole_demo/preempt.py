"""The demo's trainers of one job, preempted and resumed: with notice (SIGTERM) or without (SIGKILL).

Trainers are numbered in the order they start (trainer 1, 2, ...), each
logging to LOGS/trainer-N.log. A preemption with notice sends SIGTERM: the
trainer's `RemoteCheckpointer` saves the step it reached and the process
ends; the demo reads that step from the trainer's own log line. With `node`,
the trainer's daemon goes too: told with SIGTERM (a node drained: it takes
its runs' final saves, drains, releases their leases and exits) or, without
notice, SIGKILLed with it (a node lost). A resume starts the next trainer and
says how many steps were lost: the step the last one reached less the step
the new one restored, and, after a SIGKILL, the seconds of training they were
(from the killed trainer's own step lines).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cartpole_demo import procs

# The trainer's own log line when its save on notice is durable (checkpointd_client.notice).
SAVED_ON_NOTICE = r"run (\S+)\.train: preempted at step (\d+): saved, durable in (\d+) ms"
# From SIGTERM to a trainer's exit: its save on notice waits at most 25 s (notice_deadline).
NOTICE_SECONDS = 60.0
# From SIGTERM to a daemon's exit: its --notice-window (5 s), its drain, its leases' release.
DRAIN_SECONDS = 90.0


class Job:
    """The trainers of one run, started one after another on the daemons they are given."""

    def __init__(
        self,
        args: argparse.Namespace,
        logs: Path,
        cleanup: list[Callable[[], object]],
        *,
        run: str | None = None,
        trainer_args: Sequence[str] = (),
        numbered_after: int = 0,
    ) -> None:
        """`run` (default `args.run`) and `trainer_args` for each of its trainers; they are numbered from
        `numbered_after` + 1 (after another job's in the same demo)."""
        self.args = args
        self.logs = logs
        self.cleanup = cleanup
        self.run = run or args.run
        self.trainer_args = list(trainer_args)
        self.started = numbered_after
        self.killed: procs.Trainer | None = None  # the last trainer preempted without notice
        self.reached = 0  # the step the last preempted trainer reached
        self.ended = 0.0  # when it ended (time.monotonic())
        self.since = ""  # what ended it, for the resume's line
        self.drained: procs.Daemon | None = None  # its daemon, told with it (a node drained)
        self.lost: procs.Daemon | None = None  # its daemon, killed with it (a node lost)
        self.noticed = 0.0  # when the last preemption with notice began (time.monotonic())

    def _spawn(self, daemon: procs.Daemon, extra: Sequence[str]) -> procs.Trainer:
        self.started += 1
        a = self.args
        trainer = procs.Trainer.start(
            ["--address", daemon.address, "--run", self.run, "--steps", str(a.steps), "--save-every", str(a.save_every)]
            + self.trainer_args
            + list(extra),
            self.logs / f"trainer-{self.started}.log",
        )
        self.cleanup.append(trainer.kill)
        return trainer

    def train(self, daemon: procs.Daemon) -> procs.Trainer:
        """Starts the first trainer on `daemon`; returns it once it trains."""
        trainer = self._spawn(daemon, ())
        trainer.wait_for("restored")
        print(
            f"trainer {self.started} (pid {trainer.proc.pid}): training on daemon {daemon.name} "
            f"toward step {self.args.steps}"
        )
        return trainer

    def preempt(self, trainer: procs.Trainer, daemon: procs.Daemon, notice: bool, node: bool = False) -> int:
        """Preempts the newest trainer (with `node`, its daemon too); returns the step it reached."""
        n = self.started
        self.drained = self.lost = self.killed = None
        if not notice:
            trainer.kill()
            trainer.read_to_end()  # the steps it said before the kill landed
            self.killed = trainer
            if node:
                daemon.kill()
                self.lost = daemon
            self.reached, self.ended, self.since = trainer.step, time.monotonic(), "the kill"
            nodes = f" and daemon {daemon.name} (pid {daemon.proc.pid})" if node else ""
            print(f"preempted: SIGKILLed trainer {n} at step {trainer.step}{nodes}")
            return self.reached
        told = f"SIGTERM to trainer {n} at step {trainer.step}"
        self.noticed = time.monotonic()
        if node:
            daemon.proc.send_signal(signal.SIGTERM)
            self.drained = daemon
            print(f"node {daemon.name} drained: {told} and to daemon {daemon.name} (pid {daemon.proc.pid})", flush=True)
        else:
            print(f"preempted: {told} (a notice, as Kubernetes or a spot VM gives)", flush=True)
        code = trainer.notice(NOTICE_SECONDS)
        saved = trainer.logged(SAVED_ON_NOTICE)
        if saved is None:
            raise procs.DemoError(f"trainer {n} exited ({code}) without a save on notice; see {trainer.log}")
        if int(saved[2]) < trainer.step:
            raise procs.DemoError(f"trainer {n} saved step {saved[2]} on notice, after it said step {trainer.step}")
        how = "ended by the SIGTERM" if code == -signal.SIGTERM else f"exited ({code})"
        print(f'trainer {n} logged "{saved[0]}", then {how}')
        self.reached, self.ended, self.since = int(saved[2]), time.monotonic(), "its exit"
        return self.reached

    def resume(self, daemon: procs.Daemon, extra: Sequence[str] = ()) -> tuple[procs.Trainer, int]:
        """Starts the next trainer on `daemon`; returns it once it restored, and the step it restored.

        After a node drained, the new trainer starts at once (rescheduled as
        its predecessor exits) while the drained daemon finishes: the resume
        is timed from that daemon's exit, which releases the run to `daemon`.
        """
        if self.lost is not None:
            print(
                f"trainer {self.started + 1} starting on daemon {daemon.name}, "
                f"which takes the run once {self.lost.name}'s lease expires ...",
                flush=True,
            )
        trainer = self._spawn(daemon, extra)
        n = self.started
        if self.drained is not None:
            gone = self.drained
            try:
                code = gone.proc.wait(DRAIN_SECONDS)
            except subprocess.TimeoutExpired:
                raise procs.DemoError(
                    f"daemon {gone.name} did not exit {DRAIN_SECONDS:.0f} s after SIGTERM; see {gone.log}"
                ) from None
            self.ended, self.since = time.monotonic(), f"daemon {gone.name}'s exit"
            print(
                f"daemon {gone.name}: took the save on notice, drained, released its run leases and exited "
                f"(exit {code}) {self.ended - self.noticed:.1f} s after its SIGTERM"
            )
        step, restore_seconds, process_seconds = trainer.wait_for("restored")
        took = time.monotonic() - self.ended
        print(
            f"trainer {n} (pid {trainer.proc.pid}) on daemon {daemon.name}: resumed at step {step}, "
            f"{self.reached - int(step)} steps lost; {took:.1f} s from {self.since} to restored "
            f"(process start {float(process_seconds) - float(restore_seconds):.1f} s, "
            f"restore from the daemon {float(restore_seconds):.2f} s)"
        )
        killed = self.killed
        if killed is not None:
            seconds = killed.seconds_between(int(step), self.reached)
            lost = "?" if seconds is None else f"{seconds:.2f}"
            print(f"the SIGKILL lost {self.reached - int(step)} steps: {lost} s of trainer {n - 1}'s training")
        return trainer, int(step)

    def finish(self, trainer: procs.Trainer) -> int:
        """Waits until the newest trainer finished; returns its last step."""
        (done,) = trainer.wait_for("done")
        print(f"trainer {self.started}: finished at step {done}, every save durable")
        return int(done)
