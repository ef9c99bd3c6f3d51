"""The core is pure: importing all of it pulls in no gRPC, TensorFlow, Prometheus or NumPy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN = ("grpc", "tensorflow", "tf_agents", "prometheus_client", "numpy")
# A fresh interpreter importing a few stdlib-only modules; generous for slow CI.
LIMIT = 30.0

_PROBE = """
import importlib, json, pkgutil, sys
import checkpointd.core as core
names = [core.__name__]
for info in pkgutil.walk_packages(core.__path__, core.__name__ + "."):
    importlib.import_module(info.name)
    names.append(info.name)
print(json.dumps({"core": names, "loaded": sorted(sys.modules)}))
"""


@pytest.fixture(scope="module")
def probe() -> dict[str, list[str]]:
    """Imports every core module in a fresh interpreter; reports what got loaded."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=LIMIT
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_probe_imported_every_core_module(probe: dict[str, list[str]]) -> None:
    # Keeps the checks below from passing vacuously.
    for module in ("lane", "manifest", "numpy_state", "retention", "config", "ports"):
        assert f"checkpointd.core.{module}" in probe["core"]
        assert f"checkpointd.core.{module}" in probe["loaded"]


def test_core_loads_no_adapter_dependency(probe: dict[str, list[str]]) -> None:
    leaked = [m for m in probe["loaded"] if m.split(".")[0] in FORBIDDEN]
    assert leaked == []


def test_core_does_not_pull_in_the_adapters(probe: dict[str, list[str]]) -> None:
    adapters = [
        m
        for m in probe["loaded"]
        if m.startswith("checkpointd.")
        and not m.startswith("checkpointd.core")
        # the stdlib-only rules the core decides with
        and m not in ("checkpointd.protocol", "checkpointd.protocol.errors", "checkpointd.protocol.kinds")
    ]
    assert adapters == []
