"""The benchmark's quick mode runs end to end and writes every section.

This proves the benchmark works; it asserts nothing about the numbers beyond
"measured" (> 0), because a shared CI machine is too noisy for performance
assertions. The one exact check is the fan-in's bookkeeping: every save the
daemon accepted was written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = (
    "inprocess",
    "async",
    "remote",
    "remote_wire",
    "training",
    "limits",
    "fanin",
    "memory",
    "training_checkpoint",
)
TIMEOUT = 300  # quick mode takes ~45 s on 2 idle cores; leave room for a busy CI box


def _stats(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every {"median", "min", "max", "n", "samples"} summary under `node`."""
    if isinstance(node, dict):
        if {"median", "min", "max", "n"} <= node.keys():
            yield path, node
        else:
            for key, value in node.items():
                yield from _stats(value, f"{path}/{key}")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out), "--workdir", str(tmp / "work")],
        cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert "targets (from this run's medians)" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_section_is_measured(result: dict[str, Any]) -> None:
    for section in SECTIONS:
        assert result.get(section), f"section {section} is missing or empty"
    for section in ("inprocess", "async", "remote", "remote_wire", "training", "memory", "training_checkpoint"):
        assert list(result[section]) == ["small"]
    found = dict(_stats({s: result[s] for s in SECTIONS}))
    for section in SECTIONS:
        assert any(path.startswith(f"/{section}/") for path in found), f"{section} has no measurements"
    bad = {path: s["median"] for path, s in found.items() if not (s["n"] > 0 and s["min"] > 0)}
    assert not bad, f"measurements that are not > 0: {bad}"


@pytest.mark.slow
def test_key_measurements_are_positive(result: dict[str, Any]) -> None:
    small = "small"
    assert result["remote"][small]["save_stall"]["median"] > 0
    assert result["remote"][small]["save_latency"]["median"] > 0
    assert result["remote"][small]["save_checkpoint_latency"]["median"] > 0
    assert result["inprocess"][small]["save"]["median"] > 0
    # Same host: every snapshot of section 3 went through shared memory; 3b's over gRPC.
    reps = result["config"]["reps"][small]
    assert result["remote"][small]["transports"] == {"shm": 2 * reps, "grpc": 0}
    assert result["remote_wire"][small]["transports"] == {"shm": 0, "grpc": 2 * reps}
    assert result["async"][small]["tf_async_checkpoint"]["write_blocked"]["median"] > 0
    for saver in ("baseline", "async_policy_saver", "tf_async_checkpoint", "checkpointd"):
        assert result["training"][small]["steps_per_second"][saver]["median"] > 0
    limits = result["limits"]
    for name in ("disk_fsync", "grpc_loopback"):
        assert limits[name]["bytes_per_second"]["median"] > 0
    assert limits["memcpy"][small]["seconds"]["median"] > 0
    memory = result["memory"][small]
    assert memory["idle_rss_bytes"] > 0 and memory["first_save_peak_bytes"] > 0
    # Section 7: the whole training state, with each of the three savers.
    state = result["training_checkpoint"][small]
    assert state["remote"]["save_stall"]["median"] > 0 and state["inprocess"]["save"]["median"] > 0
    for saver in ("baseline", "checkpointer", "tf_async_checkpoint", "checkpointd"):
        assert state["training"]["steps_per_second"][saver]["median"] > 0
    assert state["training"]["saves"]["checkpointd"]["failed"] == 0


@pytest.mark.slow
def test_fanin_lost_no_accepted_save(result: dict[str, Any]) -> None:
    fanin = result["fanin"]
    assert fanin["procs"] == 2
    assert fanin["accepted"] > 0
    assert fanin["accepted"] == fanin["written"] == fanin["on_disk"] == fanin["daemon_ok"]
    assert fanin["failed"] == 0 and fanin["daemon_failed"] == 0
    assert fanin["latency_p50"] > 0 and fanin["latency_p99"] > 0


@pytest.mark.slow
def test_every_target_is_judged(result: dict[str, Any]) -> None:
    names = {t["target"] for t in result["targets"]}
    assert len(names) >= 8, names
    assert all(isinstance(t["met"], bool) for t in result["targets"])
