"""Variable manifests: what a run's snapshots must contain, byte for byte."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from checkpointd.protocol import tensors
from checkpointd.protocol.errors import InvalidRequestError, LimitExceededError


@dataclass(frozen=True)
class VariableSpec:
    """One variable: its keys in both checkpoint layouts, dtype and shape."""

    key: str
    checkpoint_key: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.key or not self.checkpoint_key:
            raise InvalidRequestError("a variable has an empty key")
        if self.dtype not in tensors.ITEMSIZE:
            raise InvalidRequestError(
                f"variable {self.key!r} has dtype {self.dtype!r}; supported: " + ", ".join(sorted(tensors.ITEMSIZE))
            )
        if any(d < 0 for d in self.shape):
            raise InvalidRequestError(f"variable {self.key!r} has a negative dimension {self.shape}")

    @functools.cached_property  # a frozen value, read several times per save
    def nbytes(self) -> int:
        return tensors.nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class Manifest:
    """The ordered variables every snapshot of a run must carry."""

    variables: tuple[VariableSpec, ...]

    def __post_init__(self) -> None:
        for attr in ("key", "checkpoint_key"):
            seen: set[str] = set()
            for v in self.variables:
                name = getattr(v, attr)
                if name in seen:
                    raise InvalidRequestError(f"variable {attr} {name!r} appears twice")
                seen.add(name)

    @functools.cached_property  # a frozen value, read several times per save
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.variables)

    def offsets(self) -> list[tuple[int, int]]:
        """(start, end) byte ranges of each variable in a snapshot."""
        ranges, start = [], 0
        for v in self.variables:
            ranges.append((start, start + v.nbytes))
            start += v.nbytes
        return ranges

    def check_variables(self, declared: Sequence[VariableSpec]) -> None:
        """Checks a save's declared variables against the manifest, one by one, in order.

        Every field counts: a variable declared under the right key but with
        another variable's checkpoint key would have the daemon's reply (and
        the trainer's restore) disagree with what the daemon writes.

        Raises:
            InvalidRequestError: naming the first variable that differs.
        """
        # Pairs up what both have; a length mismatch is reported below, after these.
        for i, (want, got) in enumerate(zip(self.variables, declared, strict=False)):
            if got.key != want.key:
                raise InvalidRequestError(f"snapshot variable #{i} is {got.key!r}; the run's manifest has {want.key!r}")
            if got.dtype != want.dtype or tuple(got.shape) != want.shape:
                raise InvalidRequestError(
                    f"snapshot variable {got.key!r} is {got.dtype}{list(got.shape)}; "
                    f"the run's manifest has {want.dtype}{list(want.shape)}"
                )
            if got.checkpoint_key != want.checkpoint_key:
                raise InvalidRequestError(
                    f"snapshot variable {got.key!r} has checkpoint_key {got.checkpoint_key!r}; "
                    f"the run's manifest has {want.checkpoint_key!r}"
                )
        if len(declared) != len(self.variables):
            first = (
                self.variables[len(declared)].key
                if len(declared) < len(self.variables)
                else declared[len(self.variables)].key
            )
            raise InvalidRequestError(
                f"snapshot has {len(declared)} variables; the run's manifest has "
                f"{len(self.variables)} (first unmatched: {first!r})"
            )

    def check_snapshot(
        self, declared: Sequence[VariableSpec], declared_bytes: int, max_bytes: int | None = None
    ) -> None:
        """Checks a save's declared snapshot (variables only) against the manifest.

        Raises:
            InvalidRequestError: naming the first variable that differs, or if
                `declared_bytes` is not the variables' size.
            LimitExceededError: if the snapshot is larger than `max_bytes`.
        """
        self.check_variables(declared)
        if declared_bytes != self.nbytes:
            raise InvalidRequestError(f"snapshot declares {declared_bytes} bytes; its variables take {self.nbytes}")
        check_limit(declared_bytes, max_bytes)


def check_limit(declared_bytes: int, max_bytes: int | None) -> None:
    """Refuses a snapshot larger than the daemon allows (`--max-snapshot-bytes`; None: no limit).

    Raises:
        LimitExceededError: naming both sizes and the option.
    """
    if max_bytes is not None and declared_bytes > max_bytes:
        raise LimitExceededError(
            f"snapshot of {declared_bytes} bytes exceeds the daemon's limit of {max_bytes} (--max-snapshot-bytes)"
        )
