"""Crash consistency: save manifests, `checkpointd verify`, and kill -9 during saves.

The crash test runs a short subset of `tests.integration.support.crash_harness`
(CHECKPOINTD_CRASH_TRIALS trials, default 6, small policy); the long mode is
`python -m tests.integration.support.crash_harness --trials 100`. The save on notice
has kill points of its own (`tests.integration.support.notice_crash`: a trainer
SIGTERMed, then it or its daemon SIGKILLed during that save), one trial each
here; its long mode is `python -m tests.integration.support.notice_crash --trials 20`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import crc32c
import numpy as np
import pytest
import tensorflow as tf
from tf_agents.policies import policy_loader, py_tf_eager_policy
from tf_agents.trajectories import time_step as ts

import checkpointd
from checkpointd.storage import save_manifest
from checkpointd.storage.verify import verify_dir
from checkpointd_client import RemotePolicySaver
from tests.integration.support import crash_harness, notice_crash, policies
from tests.integration.support.daemon import Daemon

DEADLINE = 60.0
RUN = "crash-manifest"


@pytest.fixture(scope="module")
def saves(daemon: Daemon) -> tuple[Path, Path, float]:
    """A SavedModel at step 5 and a checkpoint at step 6, saved through the daemon."""
    train_step = tf.Variable(0, dtype=tf.int64)
    policy = policies.build(policies.q())
    started = time.time()
    with RemotePolicySaver(policy, daemon.address, run=RUN, train_step=train_step, timeout=DEADLINE) as saver:
        train_step.assign(5)
        saver.save("sub/policy", blocking=True)
        train_step.assign(6)
        saver.save_checkpoint("ckpt", blocking=True)
    return daemon.root / RUN / "sub" / "policy", daemon.root / RUN / "ckpt", started


def _files(save_dir: Path) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), save_dir): Path(d, f).read_bytes()
        for d, _, names in os.walk(save_dir)
        for f in names
    }


@pytest.mark.parametrize(
    ("which", "kind", "step", "export_dir"),
    [(0, "saved_model", 5, "sub/policy"), (1, "checkpoint", 6, "ckpt")],
)
def test_each_save_lists_its_files_in_a_manifest(
    saves,
    which: int,
    kind: str,
    step: int,
    export_dir: str,  # noqa: ANN001
) -> None:
    save_dir, started = saves[which], saves[2]
    manifest = json.loads((save_dir / save_manifest.MANIFEST_NAME).read_text())
    files = _files(save_dir)
    del files[save_manifest.MANIFEST_NAME]

    assert (manifest["format"], manifest["format_version"]) == (save_manifest.FORMAT, 1)
    assert (manifest["run"], manifest["kind"], manifest["step"]) == (RUN, kind, step)
    assert manifest["export_dir"] == export_dir
    assert started <= manifest["created_unix_seconds"] <= time.time()
    assert manifest["versions"] == {
        "checkpointd": checkpointd.__version__,
        "tensorflow": tf.__version__,
        "tf_agents": importlib.metadata.version("tf-agents"),  # installed beside the daemon here
    }
    assert manifest["files"] == [
        {"path": rel, "size": len(data), "crc32c": f"{crc32c.crc32c(data):08x}"} for rel, data in sorted(files.items())
    ]
    assert verify_dir(save_dir).ok


def test_the_manifest_does_not_disturb_tf_agents_loaders(saves) -> None:  # noqa: ANN001
    saved_model, checkpoint, _ = saves
    loaded = tf.saved_model.load(str(saved_model))
    assert int(loaded.get_train_step()) == 5

    policy = py_tf_eager_policy.SavedModelPyTFEagerPolicy(str(saved_model), load_specs_from_pbtxt=True)
    assert policy.get_train_step() == 5
    assert policy.action(ts.restart(np.zeros(4, np.float32))).action.shape == ()
    policy.update_from_checkpoint(str(checkpoint))
    assert policy.get_train_step() == 6

    restored = policy_loader.load(str(saved_model), str(checkpoint))
    assert int(restored.get_train_step()) == 6


def test_verify_cli_passes_the_run_and_fails_a_damaged_copy(saves, tmp_path: Path) -> None:  # noqa: ANN001
    run_dir = saves[0].parent.parent
    command = [sys.executable, "-m", "checkpointd", "verify"]
    ok = subprocess.run([*command, str(run_dir)], capture_output=True, text=True, timeout=DEADLINE)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.endswith("2 OK, 0 FAILED\n")

    copy = shutil.copytree(run_dir, tmp_path / "copy")
    data = copy / "sub" / "policy" / "variables" / "variables.data-00000-of-00001"
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0x40
    data.write_bytes(bytes(damaged))
    bad = subprocess.run([*command, "--json", str(copy)], capture_output=True, text=True, timeout=DEADLINE)
    assert bad.returncode == 1
    reports = {Path(r["path"]).name: r for r in json.loads(bad.stdout)["dirs"]}
    assert reports["ckpt"]["ok"] is True
    assert reports["policy"]["ok"] is False
    assert "variables/variables.data-00000-of-00001 has CRC32C" in reports["policy"]["reason"]


def test_kill_9_during_saves_leaves_every_save_absent_or_complete(
    tmp_path: Path,
    record_property,  # noqa: ANN001
) -> None:
    trials = int(os.environ.get("CHECKPOINTD_CRASH_TRIALS", "6"))
    figures = crash_harness.run_trials(trials, tmp_path / "root", tmp_path / "work", sizes=("small",), seed=0)
    record_property("crash_figures", figures.summary())
    print(figures.summary())  # shown with -s; the long mode prints the same line
    assert figures.failures == [], "\n".join(figures.failures)
    assert figures.trials == trials
    assert sum(figures.kills.values()) == trials
    assert figures.saves_durable > 0 and figures.loads > 0


def test_kill_9_during_a_save_on_notice_leaves_it_absent_or_complete_and_restore_takes_the_newest(
    tmp_path: Path,
    record_property,  # noqa: ANN001
) -> None:
    trials = len(notice_crash.POINTS)  # one per kill point: the daemon staged, committing, published; the trainer
    figures = notice_crash.run_trials(trials, tmp_path / "root", tmp_path / "work", seed=0)
    record_property("notice_crash_figures", figures.summary())
    print(figures.summary())
    assert figures.failures == [], "\n".join(figures.failures)
    assert figures.trials == trials and figures.restores == trials
    assert set(figures.points) == set(notice_crash.POINTS)
