"""CheckpointManager's retention and state file, as the daemon derives them (core.checkpoint_state).

The reference is a line-for-line model of `tf.train.CheckpointManager`'s
bookkeeping (`_Manager` below: its `_maybe_delete`, `_sweep` and
`last_preserved_timestamp`), fed the same saves; the daemon's derivation from
committed checkpoints must keep and delete exactly what it does, also when
re-derived after a crash at any step of a sweep. No TensorFlow here; the
state file's text is parsed by TensorFlow in the integration tests.
"""

from __future__ import annotations

import collections
import itertools
import random
from dataclasses import dataclass

import pytest

from checkpointd.core import checkpoint_state
from checkpointd.core.checkpoint_spec import CheckpointRetention

HOUR = 3600.0


@dataclass(frozen=True)
class Ckpt:
    name: str
    created: float
    step: int


class _Manager:
    """tf.train.CheckpointManager's bookkeeping (checkpoint_management.py), without files."""

    def __init__(self, max_to_keep: int | None, hours: float | None, now: float) -> None:
        self.max_to_keep, self.hours = max_to_keep, hours
        self.maybe_delete: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.last_preserved = now - 1.0
        self.deleted: list[str] = []

    def save(self, name: str, timestamp: float) -> None:
        self.maybe_delete.pop(name, None)
        self.maybe_delete[name] = timestamp
        if not self.max_to_keep:
            return
        while len(self.maybe_delete) > self.max_to_keep:
            filename, ts = self.maybe_delete.popitem(last=False)
            if self.hours and ts - self.hours * HOUR >= self.last_preserved:
                self.last_preserved = ts
                continue
            self.deleted.append(filename)


def _replay(saves: list[Ckpt], rules: CheckpointRetention) -> tuple[list[Ckpt], float]:
    """The daemon's way: commit each save, then sweep the committed ones (what survives, the mark)."""
    committed: list[Ckpt] = []
    mark: float | None = None
    for save in saves:
        committed = [c for c in committed if c.name != save.name] + [save]
        if mark is None:
            mark = checkpoint_state.initial_mark(committed)
        swept = checkpoint_state.sweep(committed, mark, rules)
        committed = [c for c in committed if c.name not in swept.victims]
        mark = swept.state.last_preserved
    assert mark is not None
    return committed, mark


@pytest.mark.parametrize(("max_to_keep", "hours"), [(1, None), (3, None), (None, None), (2, 1.0), (3, 0.5), (1, 2.0)])
def test_the_daemon_keeps_and_deletes_what_checkpoint_manager_does(
    max_to_keep: int | None, hours: float | None
) -> None:
    rng = random.Random(max_to_keep or 0)
    clock = itertools.accumulate(rng.uniform(0.05, 0.6) * HOUR for _ in range(40))
    saves = [Ckpt(f"ckpt-{i}", 1_000_000.0 + t, i) for i, t in enumerate(clock)]
    rules = CheckpointRetention(max_to_keep, hours)
    manager = _Manager(max_to_keep, hours, now=saves[0].created)
    for s in saves:
        manager.save(s.name, s.created)

    kept, mark = _replay(saves, rules)

    assert {c.name for c in kept} == {s.name for s in saves} - set(manager.deleted)
    state = checkpoint_state.current(kept, mark)
    assert [name for name, _ in state.active] == list(manager.maybe_delete)  # the state file's list, in order
    assert mark == manager.last_preserved
    assert state.latest == saves[-1].name


def test_the_newest_checkpoint_is_never_a_victim_whatever_the_rules() -> None:
    saves = [Ckpt(f"ckpt-{i}", float(i), i) for i in range(5)]
    swept = checkpoint_state.sweep(saves, -1.0, CheckpointRetention(1, None))
    assert swept.victims == ("ckpt-0", "ckpt-1", "ckpt-2", "ckpt-3")
    assert swept.state.latest == "ckpt-4"


def test_a_sweep_interrupted_at_any_step_is_rederived_to_the_same_outcome() -> None:
    saves = [Ckpt(f"ckpt-{i}", i * 0.4 * HOUR, i) for i in range(12)]
    rules = CheckpointRetention(2, 1.0)
    mark = checkpoint_state.initial_mark(saves)
    whole = checkpoint_state.sweep(saves, mark, rules)
    assert whole.preserved and whole.victims  # both kinds of outcome happen here

    # Killed after the state file lost the victims (old mark), with none deleted yet,
    # or after deleting some: what is still committed sweeps to the same end.
    for deleted in range(len(whole.victims) + 1):
        left = [s for s in saves if s.name not in whole.victims[:deleted]]
        again = checkpoint_state.sweep(left, mark, rules)
        assert set(again.victims) == set(whole.victims[deleted:])
        assert again.state == whole.state
    # Killed after the last step: nothing left to do.
    done = [s for s in saves if s.name not in whole.victims]
    final = checkpoint_state.sweep(done, whole.state.last_preserved, rules)
    assert final.victims == () and final.state == whole.state


def test_a_checkpoint_committed_but_missing_from_the_state_file_is_active_again() -> None:
    # The daemon died between a commit and its state file: the active set is
    # derived from the committed checkpoints, so the newest one is named.
    saves = [Ckpt(f"ckpt-{i}", 10.0 + i, i) for i in range(3)]
    state = checkpoint_state.current(saves, last_preserved=9.0)
    assert state.latest == "ckpt-2" and len(state.active) == 3


def test_render_writes_checkpoint_managers_state_and_read_mark_reads_it_back_exactly() -> None:
    state = checkpoint_state.DirState((("ckpt-5", 1796118648.8595238), ("ckpt-7", 1796118650.1)), 1796118647.821787)
    text = checkpoint_state.render(state)
    assert text.splitlines() == [
        'model_checkpoint_path: "ckpt-7"',
        'all_model_checkpoint_paths: "ckpt-5"',
        'all_model_checkpoint_paths: "ckpt-7"',
        "all_model_checkpoint_timestamps: 1796118648.8595238",
        "all_model_checkpoint_timestamps: 1796118650.1",
        "last_preserved_timestamp: 1796118647.821787",
    ]
    assert checkpoint_state.read_mark(text) == 1796118647.821787
    assert checkpoint_state.read_mark("garbage") is None
    assert checkpoint_state.read_mark("last_preserved_timestamp: nan-ish") is None


def test_render_refuses_an_empty_state_and_names_that_need_escaping() -> None:
    with pytest.raises(ValueError, match="needs one"):
        checkpoint_state.render(checkpoint_state.DirState((), 0.0))
    with pytest.raises(ValueError, match="plain file name"):
        checkpoint_state.render(checkpoint_state.DirState((('ck"pt', 1.0),), 0.0))
