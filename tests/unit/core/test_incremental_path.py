"""The choice of an incremental save's path from the costs its root's saves measured (no I/O)."""

from __future__ import annotations

import pytest

from checkpointd.core.incremental_path import PATHS, ChooserConfig, IncrementalPath, PathChooser

MB = 1 << 20
CLONE, COPY, SERVER_COPY, RECEIVE = (
    IncrementalPath.CLONE,
    IncrementalPath.COPY,
    IncrementalPath.SERVER_COPY,
    IncrementalPath.RECEIVE,
)


def _choices(chooser: PathChooser, n: int, alike: str = "grpc") -> list[IncrementalPath]:
    return [chooser.choose(alike) for _ in range(n)]


@pytest.mark.parametrize("copies", [CLONE, COPY, SERVER_COPY])
def test_unmeasured_root_takes_its_own_copying_path(copies: IncrementalPath) -> None:
    chooser = PathChooser(copies, ChooserConfig(samples=1, margin=0.0, explore_every=100))
    assert _choices(chooser, 3) == [copies] * 3


def test_copying_cheaper_than_receiving_keeps_copying() -> None:
    chooser = PathChooser(COPY, ChooserConfig(samples=1, margin=0.0, explore_every=100))
    chooser.observed("grpc", seconds=1.0, received=100 * MB, copied=0)  # a full save: 10 ms/MB
    chooser.observed("grpc", seconds=0.3, received=10 * MB, copied=90 * MB)  # 0.1 s received, 0.2 s for 90 MB
    receive, copy = chooser.costs("grpc")
    assert receive == pytest.approx(1.0 / (100 * MB))
    assert copy == pytest.approx(0.2 / (90 * MB))
    assert chooser.choose("grpc") is COPY


def test_copying_dearer_than_receiving_switches_to_receiving() -> None:
    chooser = PathChooser(COPY, ChooserConfig(samples=1, margin=0.0, explore_every=100))
    chooser.observed("grpc", seconds=0.7, received=100 * MB, copied=0)
    chooser.observed("grpc", seconds=1.3, received=10 * MB, copied=90 * MB)  # the reporter's 1.85 x
    assert chooser.choose("grpc") is RECEIVE


def test_costs_are_kept_per_kind_of_save() -> None:
    chooser = PathChooser(COPY, ChooserConfig(samples=1, margin=0.0, explore_every=100))
    for transport, copy_seconds in (("grpc", 0.2), ("shm", 2.0)):
        chooser.observed(transport, seconds=1.0, received=100 * MB, copied=0)
        chooser.observed(transport, seconds=0.1 + copy_seconds, received=10 * MB, copied=90 * MB)
    assert (chooser.choose("grpc"), chooser.choose("shm")) == (COPY, RECEIVE)


def test_a_copy_before_any_full_save_prices_nothing() -> None:
    chooser = PathChooser(COPY)
    chooser.observed("grpc", seconds=5.0, received=1 * MB, copied=99 * MB)
    assert chooser.costs("grpc") == (None, None)


def test_costs_follow_the_newer_measurements() -> None:
    chooser = PathChooser(COPY, ChooserConfig(weight=0.5, samples=1, margin=0.0, explore_every=100))
    chooser.observed("grpc", seconds=1.0, received=100 * MB, copied=0)
    chooser.observed("grpc", seconds=0.2, received=10 * MB, copied=90 * MB)  # copying cheaper
    assert chooser.choose("grpc") is COPY
    for _ in range(4):  # the disk got busy: copies now cost more than receiving
        chooser.observed("grpc", seconds=2.0, received=10 * MB, copied=90 * MB)
    assert chooser.choose("grpc") is RECEIVE


def test_the_other_path_is_tried_again_after_a_streak() -> None:
    chooser = PathChooser(COPY, ChooserConfig(samples=1, margin=0.0, explore_every=4))
    chooser.observed("grpc", seconds=1.0, received=100 * MB, copied=0)
    chooser.observed("grpc", seconds=0.64, received=10 * MB, copied=90 * MB)  # copying 0.6 x receiving a byte
    assert _choices(chooser, 9) == [COPY, COPY, COPY, RECEIVE, COPY, COPY, COPY, RECEIVE, COPY]


def test_a_path_far_behind_is_tried_again_less_often() -> None:
    chooser = PathChooser(CLONE, ChooserConfig(samples=1, margin=0.0, explore_every=4))
    chooser.observed("grpc", seconds=1.0, received=100 * MB, copied=0)
    chooser.observed("grpc", seconds=0.1 + 0.9 / 5, received=10 * MB, copied=90 * MB)  # receiving 5 x a clone
    picks = _choices(chooser, 40)
    assert [i for i, p in enumerate(picks) if p is RECEIVE] == [19, 39]


def test_an_unmeasured_receive_path_is_tried_after_a_streak() -> None:
    chooser = PathChooser(SERVER_COPY, ChooserConfig(explore_every=3))
    assert _choices(chooser, 3) == [SERVER_COPY, SERVER_COPY, RECEIVE]


def test_nothing_received_or_copied_is_ignored() -> None:
    chooser = PathChooser(COPY)
    chooser.observed("grpc", seconds=1.0, received=0, copied=0)
    chooser.observed("grpc", seconds=-1.0, received=MB, copied=0)
    assert chooser.costs("grpc") == (None, None)


def test_a_root_copies_by_a_copying_path() -> None:
    with pytest.raises(ValueError, match="copies by one of"):
        PathChooser(RECEIVE)


def test_one_dear_copy_is_no_verdict_a_few_are() -> None:
    chooser = PathChooser(COPY, ChooserConfig(samples=3, explore_every=100))
    chooser.observed("grpc", seconds=1.0, received=100 * MB, copied=0)
    picks = []
    for _ in range(3):
        picks.append(chooser.choose("grpc"))
        chooser.observed("grpc", seconds=1.3, received=10 * MB, copied=90 * MB)  # copying 1.3 x receiving
    assert picks == [COPY, COPY, COPY] and chooser.choose("grpc") is RECEIVE


def test_copying_within_the_margin_of_receiving_copies() -> None:
    chooser = PathChooser(COPY, ChooserConfig(samples=1, margin=0.1, explore_every=100))
    chooser.observed("grpc", seconds=1.0, received=100 * MB, copied=0)
    chooser.observed("grpc", seconds=0.1 + 0.9 * 1.05, received=10 * MB, copied=90 * MB)  # 5 % dearer
    assert chooser.choose("grpc") is COPY
    chooser.observed("grpc", seconds=0.1 + 0.9 * 1.5, received=10 * MB, copied=90 * MB)
    assert chooser.choose("grpc") is RECEIVE


@pytest.mark.parametrize(
    "config", [dict(weight=0.0), dict(weight=1.5), dict(explore_every=1), dict(samples=0), dict(margin=-0.1)]
)
def test_config_is_checked(config: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ChooserConfig(**config)  # type: ignore[arg-type]


def test_labels_are_the_paths() -> None:
    assert PATHS == ("clone", "copy", "server_copy", "receive", "no_base")


@pytest.mark.parametrize(("choice", "path"), [("copy", CLONE), ("receive", RECEIVE)])
def test_a_fixed_choice_ignores_the_costs(choice: str, path: IncrementalPath) -> None:
    chooser = PathChooser(CLONE, ChooserConfig(choice=choice, explore_every=2))
    chooser.observed("grpc", seconds=1.0, received=100 * MB, copied=0)
    chooser.observed("grpc", seconds=9.0, received=10 * MB, copied=90 * MB)  # copying dearer
    chooser.observed("grpc", seconds=1.0, received=100 * MB, copied=0)
    assert _choices(chooser, 5) == [path] * 5


def test_an_unknown_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="one of"):
        ChooserConfig(choice="fastest")
