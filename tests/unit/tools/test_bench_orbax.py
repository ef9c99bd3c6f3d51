"""The Orbax row's pure parts: the rows a ring write covers, the shared fill, the order, the venv check, the report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.peers import orbax
from bench.peers.orbax_peer import fill, ring_spans


@pytest.mark.parametrize(
    ("start", "n", "rows", "spans"),
    [
        (3, 4, 10, [(3, 7)]),
        (8, 4, 10, [(8, 10), (0, 2)]),
        (0, 10, 10, [(0, 10)]),
        (9, 10, 10, [(9, 10), (0, 9)]),
        (5, 0, 10, []),
    ],
)
def test_ring_spans_cover_the_rows_a_ring_buffer_writes(start: int, n: int, rows: int, spans: list[Any]) -> None:
    assert ring_spans(start, n, rows) == spans
    covered = [r for lo, hi in spans for r in range(lo, hi)]
    assert covered == [(start + i) % rows for i in range(n)]


@pytest.mark.parametrize(("start", "n"), [(10, 1), (-1, 1), (0, 11), (0, -1)])
def test_ring_spans_refuse_rows_outside_the_ring(start: int, n: int) -> None:
    with pytest.raises(ValueError, match="rows from row"):
        ring_spans(start, n, 10)


@pytest.mark.parametrize("dtype", ["float32", "uint8", "int32", "int64"])
def test_fill_is_the_same_for_a_seed_and_keeps_the_dtype(dtype: str) -> None:
    a, b, other = fill([64, 3], dtype, 7), fill([64, 3], dtype, 7), fill([64, 3], dtype, 8)
    assert a.dtype == np.dtype(dtype) and a.shape == (64, 3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, other)


def test_fill_spreads_bytes_over_the_whole_range_so_they_do_not_compress() -> None:
    frames = fill([84, 84, 4], "uint8", 0)
    assert frames.min() == 0 and frames.max() == 255
    assert len(np.unique(fill([10_000], "float32", 0))) > 9_990  # normal floats: a rare float32 tie


def test_rotation_puts_each_side_first_once_per_cycle() -> None:
    orders = [orbax.rotation(rep, orbax.SIDES) for rep in range(len(orbax.SIDES))]
    assert [o[0] for o in orders] == list(orbax.SIDES)
    assert all(sorted(o) == sorted(orbax.SIDES) for o in orders)
    assert orbax.rotation(len(orbax.SIDES), orbax.SIDES) == orders[0]


def test_a_venv_is_reused_only_with_a_python_and_the_pinned_requirements(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    assert orbax.needs_install(venv)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    assert orbax.needs_install(venv)  # made, never installed
    marker = venv / "bench-requirements.txt"
    marker.write_text("jax[cpu]==0.4.0\norbax-checkpoint==0.5.0\n")
    assert orbax.needs_install(venv)  # other versions
    marker.write_text("\n".join(orbax.REQUIREMENTS) + "\n")
    assert not orbax.needs_install(venv)


def _stats(median: float) -> dict[str, Any]:
    return {"median": median, "min": median, "max": median, "n": 1, "samples": [median]}


def _case(orbax_stall: float, shm_stall: float, orbax_durable: float, shm_durable: float) -> dict[str, Any]:
    case: dict[str, Any] = {
        "state_bytes": 370_000_000,
        "arrays": 16,
        "changed_rows": 128,
        "buffer_rows": 12_863,
        "reps": [{"load_average": 3.5}, {"load_average": 5.0}],
        "memcpy": {"seconds": _stats(0.09)},
        "orbax": {k: _stats(v) for k, v in (("stall", orbax_stall), ("durable", orbax_durable), ("finished", 0.7))},
        "shm": {k: _stats(v) for k, v in (("stall", shm_stall), ("durable", shm_durable))},
    }
    case["orbax"]["bytes_on_disk"] = _stats(369e6)
    case["shm"].update(bytes_received=_stats(12e6), bytes_copied=_stats(358e6))
    case["ratios"] = orbax.ratios(case, ["orbax", "shm"])
    return case


def _result(**cases: dict[str, Any]) -> dict[str, Any]:
    return {
        "orbax": {
            "reps": 1,
            "cores": 2,
            "other_cpu_share": 0.4,
            "requirements": list(orbax.REQUIREMENTS),
            "cases": cases,
        }
    }


def test_ratios_are_checkpointd_over_orbax() -> None:
    assert orbax.ratios(_case(0.02, 0.1, 0.8, 0.4), ["orbax", "shm"]) == {
        "shm": {"stall": pytest.approx(5.0), "durable": pytest.approx(0.5)}
    }


def test_the_table_shows_each_side_and_the_ratio() -> None:
    text = "\n".join(orbax.table(_result(dqn=_case(0.02, 0.1, 0.8, 0.4))))
    assert "Orbax 0.12.8" in text
    assert "128 of 12,863 buffer rows" in text
    assert "20 ms" in text and "100 ms 5.00x" in text
    assert "400 ms 0.50x" in text
    assert "12 MB / 358 MB" in text
    assert "memcpy of the state (this machine, this run)  90 ms" in text
    assert "3.5-5.0 on 2 cores; other processes used 40% of the CPU" in text
    assert orbax.table({}) == []


def test_targets_judge_the_dqn_stall_and_both_durables_against_orbax() -> None:
    rows = orbax.targets(_result(dqn=_case(0.02, 0.01, 0.8, 0.9)))
    status = {(r["size"], "stall" if "stall" in r["target"] else "durable"): r["status"] for r in rows}
    assert status == {("dqn", "stall"): "met", ("dqn", "durable"): "MISSED", ("full", "durable"): "not measured"}
