"""Which committed saves retention deletes: a pure decision, per run and kind."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


class Save(Protocol):
    """What retention needs to know of a committed save."""

    @property
    def step(self) -> int: ...

    @property
    def created(self) -> float: ...


S = TypeVar("S", bound=Save)


def age(save: Save) -> tuple[float, int]:
    """Orders saves oldest to newest: by creation time, then by step (GetLatest's rule too)."""
    return (save.created, save.step)


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep a run's newest `keep_last` saves of each kind, plus every save at a
    step that is a multiple of `keep_every_steps`. None keeps everything.
    """

    keep_last: int | None = None
    keep_every_steps: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (the newest save is always kept), got {self.keep_last}")
        if self.keep_every_steps is not None and self.keep_every_steps < 1:
            raise ValueError(f"keep_every_steps must be >= 1, got {self.keep_every_steps}")
        if self.keep_every_steps is not None and self.keep_last is None:
            raise ValueError("keep_every_steps only thins saves past keep_last: set keep_last too")

    @property
    def enabled(self) -> bool:
        return self.keep_last is not None

    def victims(self, saves: Sequence[S]) -> list[S]:
        """The saves to delete, from saves of one run and one kind.

        The newest `keep_last` (by creation time, then step) are kept, and so
        is the newest save whatever the policy; of the older ones, those at a
        multiple of `keep_every_steps` are kept.
        """
        if self.keep_last is None:
            return []
        newest_first = sorted(saves, key=age, reverse=True)
        older = newest_first[max(1, self.keep_last) :]
        every = self.keep_every_steps
        return [s for s in older if not (every and s.step >= 0 and s.step % every == 0)]
