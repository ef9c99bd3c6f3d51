"""A trainer on TensorFlow 2.15 saves and restores through a daemon whose venv has no TensorFlow.

Two venvs: this test's (the trainer: TensorFlow, TF-Agents, the client) and
`.venv-daemon`, which `scripts/install.sh` makes with `pip install -e
".[daemon]"` alone. The daemon runs from the second: policy saves of both
kinds (with a template registered, fingerprinted and checked there), the
Restore of each, and a training checkpoint saved and restored. What it wrote
loads in TensorFlow, its fingerprint.pb is what TensorFlow's
CreateFingerprintDef gives, and its manifests record the trainer's versions.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tf_agents
from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting
from tf_agents.utils import numpy_storage

from checkpointd import __version__
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import MANIFEST_NAME
from checkpointd_client import RemoteCheckpointer, RemotePolicySaver
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, start_daemon
from tests.integration.support.raw import TIMEOUT

ROOT = Path(__file__).resolve().parents[3]
DAEMON_VENV = Path(os.environ.get("CHECKPOINTD_DAEMON_VENV", ROOT / ".venv-daemon"))
PYTHON = DAEMON_VENV / "bin" / "python"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    if not PYTHON.exists():
        message = f"no {PYTHON}: run scripts/install.sh, which makes the daemon's venv without TensorFlow"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    # The venv's own: TensorFlow is not there to import (PYTHONPATH, if set, names only the tree's source).
    probe = subprocess.run([str(PYTHON), "-c", "import tensorflow"], capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'tensorflow'" in probe.stderr
    work = tmp_path_factory.mktemp("daemon-without-tf")
    started = start_daemon(work / "root", work, python=str(PYTHON))
    try:
        yield started
    finally:
        started.terminate()


def _manifest_versions(path: Path) -> dict[str, str]:
    return json.loads(path.read_text())["versions"]


def test_policy_saves_and_restores(daemon: Daemon) -> None:
    policy = policies.build(policies.actor())
    step = tf.Variable(0, dtype=tf.int64)
    saver = RemotePolicySaver(policy, daemon.address, run="notf", train_step=step, timeout=TIMEOUT)
    try:
        saved = {}
        for kind, n in ((SaveKind.SAVED_MODEL, 4), (SaveKind.CHECKPOINT, 5)):
            policies.perturb(policy, seed=n)
            step.assign(n)
            save = saver.save if kind is SaveKind.SAVED_MODEL else saver.save_checkpoint
            save(f"{kind.value}_{n}", blocking=True).result()
            saved[kind] = (policies.values(policy), n)
        for kind, (values, n) in saved.items():
            policies.perturb(policy, seed=99)
            step.assign(0)
            restored = saver.restore(f"{kind.value}_{n}")  # the daemon reads its bundle back
            assert (restored.kind, restored.step) == (kind, n)
            assert int(step.numpy()) == n
            for got, want in zip(policies.values(policy), values, strict=True):
                assert got.tobytes() == want.tobytes()
    finally:
        saver.close(timeout=10)

    export = daemon.root / "notf" / "saved_model_4"
    loaded = tf.saved_model.load(str(export))
    policies.assert_policy_functions(loaded)
    assert int(loaded.get_train_step().numpy()) == 4
    fingerprint = bytes(fingerprinting.CreateFingerprintDef(str(export)))
    assert (export / "fingerprint.pb").read_bytes() == fingerprint
    for save in ("saved_model_4", "checkpoint_5"):
        assert _manifest_versions(daemon.root / "notf" / save / MANIFEST_NAME) == {
            "checkpointd": __version__,
            "tensorflow": tf.__version__,
            "tf_agents": tf_agents.__version__,
        }


def test_a_training_checkpoint_saves_and_restores(daemon: Daemon) -> None:
    def objects(seed: int) -> dict[str, object]:
        rng = np.random.default_rng(seed)
        state = numpy_storage.NumpyState()
        state.counts = rng.integers(0, 100, size=(7,), dtype=np.int64)
        return {
            "weights": tf.Variable(rng.standard_normal((3, 4)).astype(np.float32)),
            "global_step": tf.Variable(0, dtype=tf.int64),
            "state": state,
        }

    saved = objects(1)
    saved["global_step"].assign(12)  # type: ignore[attr-defined]
    with RemoteCheckpointer("train", daemon.address, run="notf-train", timeout=TIMEOUT, **saved) as ckpt:
        ckpt.save(saved["global_step"], blocking=True).result()
    fresh = objects(2)
    with RemoteCheckpointer("train", daemon.address, run="notf-train", timeout=TIMEOUT, **fresh) as again:
        again.initialize_or_restore()
    np.testing.assert_array_equal(fresh["weights"].numpy(), saved["weights"].numpy())  # type: ignore[attr-defined]
    assert fresh["global_step"].numpy() == 12  # type: ignore[attr-defined]
    np.testing.assert_array_equal(fresh["state"].counts, saved["state"].counts)  # type: ignore[attr-defined]
    versions = _manifest_versions(daemon.root / "notf-train" / "train" / f"ckpt-12.{MANIFEST_NAME}")
    assert versions["tensorflow"] == tf.__version__ and versions["checkpointd"] == __version__
