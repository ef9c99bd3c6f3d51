"""What one benchmark run measures: the policy sizes and how long and how often."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

OBS_DIM = 4
NUM_ACTIONS = 2
# Every DQN train step in the benchmark learns from the same batch of this shape.
TRAIN_BATCH = 32
TRAIN_STEPS_PER_SAMPLE = 2
FANIN_RATE_HZ = 5.0


@dataclass(frozen=True)
class Size:
    """A QNetwork policy size: hidden layers over a 4-float observation, 2 actions."""

    name: str
    hidden: tuple[int, ...]

    @property
    def params(self) -> int:
        """Float32 parameters of the QNetwork (weights and biases of every layer)."""
        widths = (OBS_DIM, *self.hidden, NUM_ACTIONS)
        return sum(a * b + b for a, b in itertools.pairwise(widths))

    @property
    def weight_bytes(self) -> int:
        return 4 * self.params


# About 5k, 10M and 100M parameters: 4,610, 10,023,542 and 100,080,002.
SIZES = {
    "small": Size("small", (64, 64)),
    "medium": Size("medium", (3162, 3162)),
    "large": Size("large", (10000, 10000)),
}


@dataclass(frozen=True)
class BenchConfig:
    """One run's settings.

    Attributes:
        sizes: names from SIZES, smallest first.
        reps: repetitions of each timing (and of each training window) for
            small and medium sizes.
        large_reps: the same for the large size (each copy is 400 MB).
        window_seconds: length of one training window, by size name.
        min_window_steps: a window also lasts at least this many train steps.
        fanin_procs: concurrent trainer processes in the fan-in section.
        fanin_seconds: how long each of them saves.
        limit_bytes: bytes written or streamed by the disk and gRPC limits.
        quick: the test suite's mode (proves the benchmark works, nothing more).
        workdir: where daemons, savers and the limits write.
        keep_workdir: keep `workdir` after a successful run (it is always
            kept after a failure, for the logs).
        out: the JSON file written at the end.
        training_cases: section 7's cases (bench.checkpointer.CASES).
        s3: section 8 (bench/s3/section.py): "on", "off", or "only" (nothing else).
        fleet: section 9 (bench/fleet/section.py): "on", "off", or "only" (nothing else).
        fleet_trainers: section 9's simulated trainers.
        fleet_seconds: how long each of them saves, once a second.
        incremental: the incremental case's state (bench/incremental.py).
        resume: the resume section's case (bench/resume.py): "small", "medium", "large" or "none".
        preemption: the preemption section's cases (bench/preemption.py), comma-separated of
            "small", "medium", or "none"; preemption_only: that section alone.
        orbax: run the Orbax row (bench/peers/orbax.py: Orbax's async CheckpointManager beside
            RemoteCheckpointer on the same arrays; its venv .venv-orbax is made on first use).
    """

    sizes: tuple[str, ...]
    reps: int
    large_reps: int
    window_seconds: dict[str, float]
    min_window_steps: int
    fanin_procs: int
    fanin_seconds: float
    limit_bytes: int
    quick: bool
    workdir: Path
    keep_workdir: bool
    out: Path
    training_cases: tuple[str, ...] = ()
    s3: str = "off"
    fleet: str = "off"
    fleet_trainers: int = 256
    fleet_seconds: float = 60.0
    incremental: str = "medium"  # bench/incremental.py's case: "medium", "large" (1.23 GB state) or "none"
    resume: str = "medium"
    preemption: str = "small,medium"
    preemption_only: bool = False
    orbax: bool = True

    def __post_init__(self) -> None:
        unknown = [s for s in self.sizes if s not in SIZES]
        if unknown or not self.sizes:
            raise ValueError(f"sizes must be some of {list(SIZES)}, saw {list(self.sizes)}")
        if self.reps < 1 or self.large_reps < 1:
            raise ValueError("reps must be >= 1")
        if self.fanin_procs < 1 or self.fanin_seconds <= 0:
            raise ValueError("fan-in needs >= 1 process and > 0 seconds")
        if self.s3 not in ("on", "off", "only"):
            raise ValueError(f"s3 must be on, off or only, saw {self.s3!r}")
        if self.fleet not in ("on", "off", "only"):
            raise ValueError(f"fleet must be on, off or only, saw {self.fleet!r}")
        if self.fleet_trainers < 1 or self.fleet_seconds <= 0:
            raise ValueError("the fleet needs >= 1 trainer and > 0 seconds (--fleet-trainers, --fleet-seconds)")
        if self.preemption != "none" and not set(self.preemption.split(",")) <= {"small", "medium"}:
            raise ValueError(f"--preemption takes small,medium or none, saw {self.preemption!r}")
        if self.limit_bytes < 1 << 20:
            raise ValueError("limit_bytes must be at least 1 MiB")

    def reps_for(self, size: str) -> int:
        return self.large_reps if size == "large" else self.reps
