"""Which layer may import which: the one table, checked against every import statement.

The README's "imports flow one way" is `LAYERS` below: for each layer of the
daemon (a package of `checkpointd`, or a top-level module such as
`checkpointd.server`) and for the client, the other layers it may import and
the distributions besides the stdlib it may load. The check reads each
module's source with `ast` and looks at every `import` statement in it, those
inside functions and `if TYPE_CHECKING:` blocks too. That is stricter than a
fresh interpreter importing the package (test_purity does that, for what a
layer pulls in at run time): lazy imports, such as the server's S3 store and
the storage's boto3, are never executed by an import probe, yet they are
dependencies all the same. It is also exact (the module that imports, the
line) and needs no subprocess.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TREES = {"checkpointd": ROOT / "service" / "checkpointd", "checkpointd_client": ROOT / "client" / "checkpointd_client"}


@dataclass(frozen=True)
class Layer:
    """What a layer's modules may import besides themselves and the stdlib."""

    layers: frozenset[str]  # other layers (keys of LAYERS)
    distributions: frozenset[str] = (
        frozenset()
    )  # top-level names of installed packages ("google.protobuf" for protobuf)


def _layer(layers: set[str], distributions: set[str] | None = None) -> Layer:
    return Layer(frozenset(layers), frozenset(distributions or ()))


# From the bottom up. `checkpointd` is the package's own __init__ (its version).
LAYERS: dict[str, Layer] = {
    "checkpointd": _layer(set()),
    "v1": _layer(set(), {"google.protobuf", "grpc"}),  # generated
    "protocol": _layer({"v1"}, {"crc32c", "google.protobuf", "grpc"}),
    "core": _layer({"protocol"}),
    # The durability toolkit: below formats and storage, so neither imports the other.
    "durable": _layer({"core", "protocol"}),
    # The tensor bundle, TensorFlow's format without TensorFlow: what each kind of save is written in.
    "bundle": _layer({"core", "durable", "protocol", "v1"}, {"crc32c", "google.protobuf"}),
    "formats": _layer(
        {"bundle", "checkpointd", "core", "durable", "protocol", "v1"}, {"crc32c", "farmhash", "google.protobuf"}
    ),
    "storage": _layer({"core", "durable", "protocol"}, {"crc32c"}),
    # The object store: a package with one public face (its __init__), over what local storage shares.
    "storage.s3": _layer({"core", "durable", "protocol", "storage"}, {"boto3", "botocore", "crc32c"}),
    "metrics": _layer({"core", "protocol"}, {"prometheus_client"}),
    # The same-host shared-memory transport of snapshots (the run's segment and its busy lock).
    "transport": _layer({"core", "protocol"}),
    # The use cases reach formats and storage only through core.ports' Protocols; server.py picks them.
    "saves": _layer({"core", "durable", "protocol", "transport"}),
    # Restoring is a use case too: a committed save found through the saves' catalog.
    "restores": _layer({"core", "protocol", "saves"}),
    "rpc": _layer({"core", "protocol", "restores", "saves", "transport", "v1"}, {"grpc"}),
    # What the daemon takes of its host (dir lock, shared memory, port file), for the composition root.
    "host": _layer({"core", "durable", "protocol", "saves", "storage", "transport"}),
    # The composition root: everything below the CLI.
    "server": _layer(
        {
            "bundle",
            "checkpointd",
            "core",
            "durable",
            "formats",
            "host",
            "metrics",
            "protocol",
            "restores",
            "rpc",
            "saves",
            "storage",
            "storage.s3",
            "transport",
            "v1",
        },
        {"grpc", "grpc_health", "grpc_reflection", "prometheus_client"},
    ),
    "cli": _layer(
        {"checkpointd", "core", "protocol", "rpc", "saves", "server", "storage", "storage.s3", "v1"},
        {"crc32c", "google.protobuf", "grpc"},
    ),
    "__main__": _layer({"cli"}),
    # The trainer side shares only the protocol and the generated code with the daemon.
    "checkpointd_client": _layer({"protocol", "v1"}, {"grpc", "numpy", "tensorflow", "tf_agents"}),
}
# Packages whose modules are private: code outside one imports only the package itself (its __init__).
FACES = frozenset({"checkpointd.storage.s3"})
# Single modules held to less than their layer.
MODULES: dict[str, frozenset[str]] = {
    # Parsing the command line is pure: no store, no server, no filesystem probe.
    "checkpointd.cli.parse": frozenset({"checkpointd", "core", "protocol"}),
    "checkpointd.cli.serve_flags": frozenset({"checkpointd", "core", "protocol"}),
    "checkpointd.cli.flags": frozenset({"checkpointd", "core", "protocol"}),
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # what it imports, as a module name
    line: int


def modules(trees: dict[str, Path]) -> dict[str, Path]:
    """Every module of the trees, by name (a package by its `__init__.py`)."""
    found = {}
    for top, tree in trees.items():
        for path in sorted(tree.rglob("*.py")):
            parts = path.relative_to(tree).with_suffix("").parts
            found[".".join((top, *parts[:-1]) if parts[-1] == "__init__" else (top, *parts))] = path
    return found


def imports(module: str, path: Path, known: set[str]) -> list[Import]:
    """Every import statement of a module, anywhere in it, resolved to module names.

    `from checkpointd import durable` names the module `checkpointd.durable`
    (it is in `known`); `from checkpointd import __version__` names
    `checkpointd` itself.
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(module, sub if sub in known else base, node.lineno))
    return found


def layer_of(module: str, layers: dict[str, Layer] | None = None) -> str:
    """`checkpointd.<package>...` -> the package, or its sub-package if `layers` has one of its own
    (`storage.s3`); `checkpointd.<module>` -> the module; the client is one layer."""
    parts = module.split(".")
    if parts[0] != "checkpointd":
        return parts[0]
    if len(parts) > 2 and f"{parts[1]}.{parts[2]}" in (LAYERS if layers is None else layers):
        return f"{parts[1]}.{parts[2]}"
    return parts[1] if len(parts) > 1 else "checkpointd"


def _behind_a_face(importer: str, target: str, faces: frozenset[str]) -> str | None:
    """The face `target` is a private module of, if `importer` is outside that package; else None."""
    for face in faces:
        if target.startswith(face + ".") and not (importer == face or importer.startswith(face + ".")):
            return face
    return None


def _distribution(target: str) -> str:
    return "google.protobuf" if target.startswith("google.") or target == "google" else target.partition(".")[0]


def violations(
    trees: dict[str, Path],
    layers: dict[str, Layer],
    narrower: dict[str, frozenset[str]],
    faces: frozenset[str] = frozenset(),
) -> list[str]:
    """What the table forbids, one line per import: `module:line imports target (layer -> layer)`,
    or `module:line reaches behind face`."""
    found = modules(trees)
    known = set(found)
    ours = set(trees)
    problems = []
    for module, path in found.items():
        own = layer_of(module, layers)
        if own not in layers:
            problems.append(f"{module} is in no layer: add {own!r} to the table")
            continue
        for imp in imports(module, path, known):
            top = imp.target.partition(".")[0]
            face = _behind_a_face(module, imp.target, faces)
            if face is not None:
                problems.append(f"{module}:{imp.line} reaches behind {face} into {imp.target}: import it from {face}")
            if top in ours:
                theirs = layer_of(imp.target, layers)
                allowed = narrower.get(module, layers[own].layers)
                if theirs != own and theirs not in allowed:
                    problems.append(f"{module}:{imp.line} imports {imp.target} ({own} -> {theirs})")
            elif top not in sys.stdlib_module_names and _distribution(imp.target) not in layers[own].distributions:
                problems.append(f"{module}:{imp.line} imports {imp.target} ({own} -> {_distribution(imp.target)})")
    return problems


# --- the tree -----------------------------------------------------------------


def test_every_module_is_in_a_layer_and_every_layer_has_modules() -> None:
    found = modules(TREES)
    assert {layer_of(m) for m in found} == set(LAYERS)  # a new package or top-level module must be placed here
    assert set(MODULES) <= set(found)
    assert len(found) > 80


def test_every_import_follows_the_table() -> None:
    assert violations(TREES, LAYERS, MODULES, FACES) == []


def test_the_daemon_has_no_import_cycle() -> None:
    # Every import statement counts, those under `if TYPE_CHECKING:` too: a helper typed by the
    # class that imports it is a circle all the same.
    found = modules({"checkpointd": TREES["checkpointd"]})
    graph = {
        m: {i.target for i in imports(m, p, set(found)) if i.target in found and i.target != m}
        for m, p in found.items()
    }
    assert _cycle(graph) == []


def test_the_scan_sees_the_imports_the_layers_rely_on() -> None:
    # Keeps the check from passing vacuously: lazy and relative imports are read too.
    found = modules(TREES)
    server = {i.target for i in imports("checkpointd.server", found["checkpointd.server"], set(found))}
    assert {"checkpointd.storage.s3", "checkpointd.rpc.servicer", "checkpointd.saves.pipeline"} <= server
    assert (
        layer_of("checkpointd.storage.s3.store") == "storage.s3" and layer_of("checkpointd.storage.local") == "storage"
    )
    name = "checkpointd.formats.policy_template"
    template = {i.target for i in imports(name, found[name], set(found))}
    assert {"checkpointd.v1.tf_formats_pb2", "checkpointd.formats.object_graph"} <= template


def test_no_daemon_layer_may_import_tensorflow() -> None:
    # The daemon moves bytes; TensorFlow lives in the trainer (the client's layer).
    daemon = {name: layer for name, layer in LAYERS.items() if name != "checkpointd_client"}
    assert not [name for name, layer in daemon.items() if {"tensorflow", "tf_agents"} & layer.distributions]
    assert "tensorflow" in LAYERS["checkpointd_client"].distributions  # the check reads the names it means


# --- the checker itself -------------------------------------------------------

_TABLE = {
    "checkpointd": _layer(set()),
    "core": _layer(set()),
    "formats": _layer({"core"}, {"numpy"}),
    "storage": _layer({"core"}),
    "saves": _layer({"core"}),
}


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in {"__init__.py": "", **files}.items():
        path = tmp_path / "checkpointd" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"checkpointd": tmp_path / "checkpointd"}


def _base(**extra: str) -> dict[str, str]:
    return {
        "core/__init__.py": "",
        "core/ports.py": "import os\n",
        "formats/__init__.py": "",
        "formats/policy.py": "import numpy\nfrom checkpointd.core import ports\n",
        "storage/__init__.py": "",
        "storage/local.py": "from ..core.ports import *\n",
        "saves/__init__.py": "",
        **extra,
    }


def test_a_tree_that_follows_its_table_passes(tmp_path: Path) -> None:
    assert violations(_tree(tmp_path, _base()), _TABLE, {}) == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        # upward: the core importing a use case
        (
            "core/lane.py",
            "from checkpointd.saves import pipeline\n",
            "checkpointd.core.lane:1 imports checkpointd.saves",
        ),
        # sideways, lazily, inside a function
        (
            "formats/training.py",
            "def f():\n    from checkpointd.storage import local\n",
            "checkpointd.formats.training:2 imports checkpointd.storage.local (formats -> storage)",
        ),
        # sideways, relative
        ("storage/s3.py", "from ..formats import policy\n", "imports checkpointd.formats.policy (storage -> formats)"),
        # `from checkpointd import <package>`
        ("saves/runs.py", "from checkpointd import formats\n", "imports checkpointd.formats (saves -> formats)"),
        # a distribution the layer may not load
        ("core/clock.py", "import grpc\n", "checkpointd.core.clock:1 imports grpc (core -> grpc)"),
        # a new package nobody placed
        ("bundle/__init__.py", "", "checkpointd.bundle is in no layer"),
    ],
)
def test_an_import_against_the_table_is_reported(tmp_path: Path, module: str, source: str, expected: str) -> None:
    problems = violations(_tree(tmp_path, _base(**{module: source})), _TABLE, {})
    assert len(problems) == 1
    assert expected in problems[0]


def test_a_sub_package_is_its_own_layer_behind_its_face(tmp_path: Path) -> None:
    table = {**_TABLE, "storage.s3": _layer({"core", "storage"})}
    files = {"storage/s3/__init__.py": "from .store import S3Store\n", "storage/s3/store.py": "from ..local import *\n"}
    assert violations(_tree(tmp_path / "a", _base(**files)), table, {}, frozenset({"checkpointd.storage.s3"})) == []
    inward = {**files, "saves/runs.py": "from checkpointd.storage.s3 import store\n"}
    problems = violations(_tree(tmp_path / "b", _base(**inward)), table, {}, frozenset({"checkpointd.storage.s3"}))
    assert any("reaches behind checkpointd.storage.s3 into checkpointd.storage.s3.store" in p for p in problems)
    upward = {**files, "storage/local.py": "from checkpointd.storage.s3 import S3Store\n"}
    assert violations(_tree(tmp_path / "c", _base(**upward)), table, {}) == [
        "checkpointd.storage.local:1 imports checkpointd.storage.s3 (storage -> storage.s3)"
    ]


def test_a_module_rule_is_narrower_than_its_layer(tmp_path: Path) -> None:
    trees = _tree(tmp_path, _base(**{"saves/parse.py": "from checkpointd.core import ports\n"}))
    assert violations(trees, _TABLE, {}) == []
    assert violations(trees, _TABLE, {"checkpointd.saves.parse": frozenset()}) == [
        "checkpointd.saves.parse:1 imports checkpointd.core.ports (saves -> core)"
    ]


# --- the bench ----------------------------------------------------------------


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (module -> the modules it imports), or [] if it has none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt, [*path, node])
            if found:
                return found
        done.add(node)
        return []

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return []


def test_the_bench_has_no_import_cycle() -> None:
    # Its judging helpers (bench.judge, bench.fmt) sit below the report and the sections that use them.
    found = modules({"bench": ROOT / "bench"})
    graph = {
        m: {i.target for i in imports(m, p, set(found)) if i.target in found and i.target != m}
        for m, p in found.items()
    }
    assert _cycle(graph) == []
    assert {m for m in found if "bench.report" in graph[m]} <= {"bench.__main__"}


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
