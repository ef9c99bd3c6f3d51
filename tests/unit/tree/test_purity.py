"""What importing the core, the protocol and the client pulls in.

The core is pure (stdlib only), the protocol carries only what its codecs need,
and the client shares only `checkpointd.protocol` and `checkpointd.v1` with
the daemon. Each probe imports a package's modules in a fresh interpreter and
reports the modules that import added to `sys.modules`. Which layer may
import which is `test_layers.LAYERS` (checked statically, every import
statement); this checks what those imports load at run time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.unit.tree.test_layers import LAYERS

# A fresh interpreter importing a package; the client's imports TensorFlow.
# Generous for a loaded CI machine: a hang fails, a slow import does not.
LIMIT = 120.0
ROOT = Path(__file__).resolve().parents[3]
PACKAGE_DIRS = {
    "checkpointd.core": ROOT / "service" / "checkpointd" / "core",
    "checkpointd.protocol": ROOT / "service" / "checkpointd" / "protocol",
    "checkpointd_client": ROOT / "client" / "checkpointd_client",
}

# Modules of the protocol the core may use: the stdlib-only rules and tables it
# decides with (errors, save kinds, names, dtype sizes, the default port).
CORE_MAY_USE = (
    "checkpointd.protocol",
    "checkpointd.protocol.address",
    "checkpointd.protocol.errors",
    "checkpointd.protocol.kinds",
    "checkpointd.protocol.names",
    "checkpointd.protocol.tensors",
)
# What each protocol module may load besides the stdlib and the protocol itself
# (owners as `_owner` names them). The stdlib-only ones are those the core uses;
# kinds maps to the wire enum only when asked, importing checkpointd.v1 then.
PROTOCOL_NEEDS: dict[str, set[str]] = {
    **{module: set() for module in CORE_MAY_USE},
    "checkpointd.protocol.busy_lock": set(),  # stdlib only (fcntl, os)
    "checkpointd.protocol.varint": set(),  # stdlib only
    "checkpointd.protocol.bundle_table": {"crc32c"},  # the index table, shared with the client
    "checkpointd.protocol.codes": {"grpc"},
    "checkpointd.protocol.credentials": {"grpc"},
    "checkpointd.protocol.wire": {"crc32c", "protobuf", "checkpointd.v1"},
    "checkpointd.protocol.increments": {"crc32c", "protobuf", "checkpointd.v1"},
    "checkpointd.protocol.standby": {"crc32c", "protobuf", "checkpointd.v1"},
}
# grpc/__init__.py imports these packages, when installed, to alias them as
# grpc.tools, grpc.health and grpc.reflection; their __init__s are empty. What
# the daemon uses of them (the health and reflection services) is in submodules.
_GRPC_ALIASES = {"grpc_tools", "grpc_health", "grpc_reflection"}

_PROBE = """
import importlib, json, pkgutil, sys
before = set(sys.modules)
target, walk = sys.argv[1], sys.argv[2] == "walk"
names = [importlib.import_module(target).__name__]
if walk:
    for info in pkgutil.walk_packages(sys.modules[target].__path__, target + "."):
        names.append(importlib.import_module(info.name).__name__)
print(json.dumps({"imported": names, "added": sorted(set(sys.modules) - before)}))
"""


@dataclass(frozen=True)
class Probe:
    imported: list[str]  # the modules the probe imported itself
    added: list[str]  # every module that importing them added to sys.modules


def _probe(target: str, *, walk: bool) -> Probe:
    """Imports `target` (and, with `walk`, every module under it) in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, target, "walk" if walk else "one"],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    if done.returncode != 0:
        pytest.fail(f"importing {target} failed:\n{done.stderr[-4000:]}")  # the traceback, past TF's warnings
    return Probe(**json.loads(done.stdout.splitlines()[-1]))


def _owner(name: str) -> str:
    """What a loaded module belongs to: "stdlib", a checkpointd package, or a distribution."""
    top = name.partition(".")[0]
    if top in sys.stdlib_module_names:
        return "stdlib"
    if top == "checkpointd":
        return ".".join(name.split(".")[:2])  # "checkpointd" itself, or checkpointd.<package>
    if name == "google" or name.startswith(("google.protobuf", "google._upb")):
        return "protobuf"
    if name in _GRPC_ALIASES or top == "cython_runtime" or top.startswith("_cython_"):
        return "grpc"  # the aliases above, and the runtime of grpc's Cython extension
    return top


def _modules_on_disk(package: str) -> set[str]:
    """Every module of `package`, from its files: what a full walk must import."""
    found = set()
    for path in PACKAGE_DIRS[package].rglob("*.py"):
        parts = path.relative_to(PACKAGE_DIRS[package]).with_suffix("").parts
        found.add(".".join((package, *parts[:-1]) if parts[-1] == "__init__" else (package, *parts)))
    return found


def _assert_walked_all_of(probe: Probe, package: str) -> None:
    # Keeps the checks from passing vacuously: every module was imported, by this probe.
    expected = _modules_on_disk(package)
    assert len(expected) > 3
    assert set(probe.imported) == expected
    assert expected <= set(probe.added)


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# --- the core -----------------------------------------------------------------


@pytest.fixture(scope="module")
def core() -> Probe:
    return _probe("checkpointd.core", walk=True)


def test_the_probe_imported_every_core_module(core: Probe) -> None:
    _assert_walked_all_of(core, "checkpointd.core")
    for module in ("lane", "variable_manifest", "numpy_state", "retention", "config", "ports"):
        assert f"checkpointd.core.{module}" in core.imported


def test_core_loads_no_adapter_dependency(core: Probe) -> None:
    forbidden = ("grpc", "google.protobuf", "tensorflow", "tf_agents", "prometheus_client", "numpy", "crc32c")
    assert [m for m in core.added if _within(m, forbidden)] == []


def test_core_loads_only_the_stdlib(core: Probe) -> None:
    assert {_owner(m) for m in core.added} <= {"stdlib", "checkpointd", "checkpointd.core", "checkpointd.protocol"}


def test_core_does_not_pull_in_the_adapters(core: Probe) -> None:
    outside = [
        m
        for m in core.added
        if _within(m, ("checkpointd",)) and m != "checkpointd" and not _within(m, ("checkpointd.core",))
    ]
    assert [m for m in outside if m not in CORE_MAY_USE] == []


# --- the protocol -------------------------------------------------------------


@pytest.fixture(scope="module")
def protocol() -> Probe:
    return _probe("checkpointd.protocol", walk=True)


def test_the_probe_imported_every_protocol_module(protocol: Probe) -> None:
    _assert_walked_all_of(protocol, "checkpointd.protocol")
    # A new protocol module must say here what it may load.
    assert set(PROTOCOL_NEEDS) == _modules_on_disk("checkpointd.protocol")


def test_protocol_loads_no_tensorflow_prometheus_or_daemon_module(protocol: Probe) -> None:
    forbidden = ("tensorflow", "tf_agents", "prometheus_client", "grpc_health", "grpc_reflection")
    assert [m for m in protocol.added if _within(m, forbidden) and m not in _GRPC_ALIASES] == []
    daemon = [m for m in protocol.added if _within(m, ("checkpointd",)) and m != "checkpointd"]
    assert [m for m in daemon if not _within(m, ("checkpointd.protocol", "checkpointd.v1"))] == []


@pytest.mark.parametrize("module", sorted(PROTOCOL_NEEDS))
def test_each_protocol_module_loads_only_what_it_needs(module: str) -> None:
    probe = _probe(module, walk=False)
    assert module in probe.added
    owners = {_owner(m) for m in probe.added} - {"stdlib", "checkpointd", "checkpointd.protocol"}
    assert owners <= PROTOCOL_NEEDS[module]


@pytest.mark.parametrize("module", CORE_MAY_USE)
def test_the_protocol_the_core_uses_is_stdlib_only(module: str) -> None:
    probe = _probe(module, walk=False)
    assert module in probe.added
    assert [m for m in probe.added if _owner(m) not in ("stdlib", "checkpointd", "checkpointd.protocol")] == []


# --- the daemon ---------------------------------------------------------------


_DAEMON_PROBE = """
import importlib, json, pkgutil, sys
import checkpointd
before = set(sys.modules)
for info in pkgutil.walk_packages(checkpointd.__path__, "checkpointd."):
    if not info.name.endswith(".__main__"):  # it runs the CLI
        importlib.import_module(info.name)
print(json.dumps({"added": sorted(set(sys.modules) - before)}))
"""


def test_no_daemon_module_loads_tensorflow() -> None:
    # The daemon moves bytes: with every module of it imported, TensorFlow is not among what they loaded.
    done = subprocess.run([sys.executable, "-c", _DAEMON_PROBE], capture_output=True, text=True, timeout=LIMIT)
    assert done.returncode == 0, done.stderr[-4000:]
    added = json.loads(done.stdout.splitlines()[-1])["added"]
    assert {"checkpointd.server", "checkpointd.formats.policy_template", "checkpointd.bundle.reader"} <= set(added)
    assert [m for m in added if _within(m, ("tensorflow", "tf_agents", "keras", "tensorboard"))] == []


# --- the client ---------------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Probe:
    return _probe("checkpointd_client", walk=True)


def test_the_probe_imported_every_client_module(client: Probe) -> None:
    _assert_walked_all_of(client, "checkpointd_client")
    assert {"checkpointd_client.saver", "checkpointd_client.trigger"} <= set(client.imported)


def test_client_imports_only_protocol_and_v1_of_the_daemon(client: Probe) -> None:
    shared = tuple(f"checkpointd.{layer}" for layer in sorted(LAYERS["checkpointd_client"].layers))
    assert shared == ("checkpointd.protocol", "checkpointd.v1")
    daemon = [m for m in client.added if _within(m, ("checkpointd",)) and m != "checkpointd"]
    assert daemon, "the client uses the protocol and v1"
    assert [m for m in daemon if not _within(m, shared)] == []


def test_client_loads_no_daemon_dependency(client: Probe) -> None:
    # TensorFlow and tf_agents are the trainer's own; these are the daemon's.
    forbidden = ("prometheus_client", "grpc_health", "grpc_reflection")
    assert "grpc" in client.added
    assert [m for m in client.added if _within(m, forbidden) and m not in _GRPC_ALIASES] == []
