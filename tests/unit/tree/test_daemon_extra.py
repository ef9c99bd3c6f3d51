"""What a daemon host installs: `pip install ".[daemon]"` brings no TensorFlow.

The daemon moves bytes: the base dependencies and the daemon extra name no
TensorFlow, TF-Agents or NumPy (tests/integration/ops/test_daemon_without_tf.py
runs a daemon from exactly that install); the client extra and the tests
keep theirs.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
TRAINER_ONLY = ("tensorflow", "tensorflow-cpu", "tf-agents", "tensorflow-probability", "numpy", "tensorboard")


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_daemon_install_names_no_tensorflow() -> None:
    daemon = _names(PROJECT["dependencies"]) | _names(PROJECT["optional-dependencies"]["daemon"])
    assert {"grpcio", "protobuf", "crc32c", "prometheus-client", "boto3", "pyfarmhash"} <= daemon
    assert daemon.isdisjoint(TRAINER_ONLY)


def test_the_trainer_side_keeps_what_it_needs() -> None:
    client = _names(PROJECT["optional-dependencies"]["client"])
    assert {"tf-agents", "numpy"} <= client


def test_the_image_installs_the_daemon_extra_alone() -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    installs = re.findall(r"pip install (\S+)", dockerfile)
    assert installs == ['".[daemon]"']
    assert "TF_CPP_MIN_LOG_LEVEL" not in dockerfile


def test_trainer_versions_are_bounded() -> None:
    from checkpointd.protocol.errors import InvalidRequestError
    from checkpointd.rpc import messages

    assert messages.trainer_versions({"tensorflow": "2.15.1", "tf_agents": "0.19.0"}) == {
        "tensorflow": "2.15.1",
        "tf_agents": "0.19.0",
    }
    for bad in ({"": "1"}, {"tensorflow": "x" * 129}, {f"k{i}": "1" for i in range(17)}):
        with pytest.raises(InvalidRequestError, match="trainer_versions"):
            messages.trainer_versions(bad)
