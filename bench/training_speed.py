"""Sections 2 and 3: DQN training steps/s with no saves, and with each saver at one cadence.

A window trains for a while; with a saver, a save is requested every
`cadence` seconds between train steps (what a training loop does). The time a
request blocks the loop counts against the window, as it would in training.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bench.agents import Trainer


class CadencedSaver(Protocol):
    """One saver driven by the training loop."""

    name: str

    def request(self, index: int) -> None:
        """Asks for a save (never waits for it to be written)."""

    def finish(self) -> dict[str, int]:
        """Waits for saves in flight; returns counts (requested, written, ...) and cleans up."""


@dataclass
class Window:
    steps: int
    seconds: float
    counts: dict[str, int]
    request_seconds: float = 0.0  # time the loop spent inside the saver's calls

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds


def train_window(
    trainer: Trainer,
    seconds: float,
    min_steps: int,
    saver: CadencedSaver | None = None,
    cadence: float = 1.0,
) -> Window:
    """Trains for at least `seconds` and `min_steps`; with `saver`, requests a save every `cadence` s.

    The first save is requested at the start of the window, and at most one
    per train step (a step longer than the cadence gets one request).
    """
    steps = requested = 0
    in_requests = 0.0
    start = time.perf_counter()
    next_save = start
    while True:
        now = time.perf_counter()
        if saver is not None and now >= next_save:
            saver.request(requested)
            in_requests += time.perf_counter() - now
            requested += 1
            next_save += cadence
            if next_save < now:  # a step longer than the cadence: do not queue a burst
                next_save = now + cadence
        trainer.step()
        steps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and steps >= min_steps:
            break
    counts = saver.finish() if saver is not None else {}
    return Window(steps, elapsed, counts, in_requests)


class AsyncPolicySaverDriver:
    """AsyncPolicySaver.save at a cadence; its silent skips are counted from the disk."""

    name = "async_policy_saver"

    def __init__(self, asaver: Any, out: Path) -> None:
        self._asaver, self._out = asaver, out
        self._dirs: list[Path] = []

    def request(self, index: int) -> None:
        target = self._out / f"window-{len(self._dirs)}"
        self._dirs.append(target)
        self._asaver.save(str(target))

    def finish(self) -> dict[str, int]:
        self._asaver.flush()
        written = sum((d / "saved_model.pb").exists() for d in self._dirs)
        counts = {"requested": len(self._dirs), "written": written}
        _rm_all(self._dirs)
        return counts


class TfAsyncCheckpointDriver:
    """tf.train.Checkpoint.write with async checkpointing at a cadence."""

    name = "tf_async_checkpoint"

    def __init__(self, checkpoint: Any, options: Any, out: Path) -> None:
        self._checkpoint, self._options, self._out = checkpoint, options, out
        self._dirs: list[Path] = []

    def request(self, index: int) -> None:
        target = self._out / f"tf-window-{len(self._dirs)}"
        self._dirs.append(target)
        self._checkpoint.write(str(target / "ckpt"), options=self._options)

    def finish(self) -> dict[str, int]:
        self._checkpoint.sync()
        written = sum((d / "ckpt.index").exists() for d in self._dirs)
        counts = {"requested": len(self._dirs), "written": written}
        _rm_all(self._dirs)
        return counts


class CheckpointdDriver:
    """RemotePolicySaver.save at a cadence; outcomes come from the tickets."""

    name = "checkpointd"

    def __init__(self, saver: Any, run_root: Path, prefix: str, timeout: float) -> None:
        self._saver, self._run_root, self._prefix, self._timeout = saver, run_root, prefix, timeout
        self._tickets: list[Any] = []

    def request(self, index: int) -> None:
        self._tickets.append(self._saver.save(f"{self._prefix}-{len(self._tickets)}"))

    def finish(self) -> dict[str, int]:
        self._saver.flush(self._timeout)
        skipped = sum(t.skipped for t in self._tickets)
        written = failed = 0
        for t in self._tickets:
            if not t.skipped:
                if t.exception(self._timeout) is None:
                    written += 1
                else:
                    failed += 1
        counts = {
            "requested": len(self._tickets),
            "accepted": len(self._tickets) - skipped,
            "skipped": skipped,
            "written": written,
            "failed": failed,
        }
        _rm_all([self._run_root / t.export_dir for t in self._tickets])
        self._tickets = []
        return counts


def _rm_all(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
    paths.clear()


def interleaved_windows(
    trainer: Trainer,
    drivers: list[CadencedSaver],
    reps: int,
    seconds: float,
    min_steps: int,
    cadence: float,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, list[Window]]:
    """`reps` rounds of: a window with no saves, then one window per driver.

    Interleaving spreads the machine's drift over every variant alike.
    """
    windows: dict[str, list[Window]] = {"baseline": []}
    for d in drivers:
        windows[d.name] = []
    for r in range(reps):
        windows["baseline"].append(train_window(trainer, seconds, min_steps))
        for d in drivers:
            windows[d.name].append(train_window(trainer, seconds, min_steps, d, cadence))
        progress(
            f"training round {r + 1}/{reps}: "
            + ", ".join(f"{k} {w[-1].steps_per_second:.2f}/s" for k, w in windows.items())
        )
    return windows
