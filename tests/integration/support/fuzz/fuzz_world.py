"""The fuzz's world: its runs, names and limits, what a scenario is, and the path oracles.

A `Scenario` is one fuzzed request (or a short fixed sequence) and what the
daemon may answer to it; the `World` holds the fixed facts strategies build
requests from. The strategies are in fuzz_saves.py (saves and their
snapshots), fuzz_restores.py (what reads saves back), fuzz_incremental.py
(what a trainer on the daemon's host or with a base sends) and
fuzz_requests.py (registration, the other RPCs, random messages and bytes,
and `scenarios`, the mix test_fuzz.py sends).
"""

from __future__ import annotations

import math
import os
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import crc32c
import grpc
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message as pb_message
from hypothesis import strategies as st
from tensorflow.core.protobuf import trackable_object_graph_pb2

from checkpointd.v1 import checkpointd_pb2 as pb
from tests.integration.support.raw import Template

Code = grpc.StatusCode

# The daemon's limits the scenarios are built against (test_fuzz starts it so).
MAX_SNAPSHOT = 1 << 20  # --max-snapshot-bytes: huge declared sizes meet the limit cheaply
MAX_TEMPLATE = 16 << 20  # --max-template-bytes
DATA_FILE = "variables/variables.data-00000-of-00001"

# Runs. Saves are counted for MAIN runs only: nothing else registers them.
MAIN = "fz-a"
MAIN_FOLDERED = "fz-b"  # registered with a folder of another name
MAIN_FOLDER = "fz-b-folder"
CLOSED = "fz-closed"  # registered, then closed: saves get FAILED_PRECONDITION
CLOSABLE = ("fz-c0", "fz-c1")  # CloseRun targets; re-registered when closed
REG_POOL = ("fz-r0", "fz-r1", "fz-r2")  # what fuzzed RegisterRun calls may register
UNKNOWN = ("fz-never", "x", "A" * 128)
# A training run (RegisterRun kind TRAINING_CHECKPOINT): its saves carry their own tensors.
MAIN_TRAINING = "fz-t"
# A training run whose saves are one chunk: incremental saves get a base (fuzz_incremental.py).
BIG_TRAINING = "fz-big"
COUNTED = (MAIN, MAIN_FOLDERED, MAIN_TRAINING, BIG_TRAINING)  # the runs whose counts the fuzz checks at the end
SKIP_REPORT_VARIANTS = (
    "save-good",
    "save-bad-export-dir",
    "save-wrong-size",
    "save-unknown-run",
    "save-bad-kind",
    "save-bad-skip-kind",
    "flush",
    "flush-no-run",
    "flush-unknown-run",
    "flush-nan",
    "flush-bad-skip-kind",
)
TRAINING_DIRS = ("t0", "t1", "nest/t2", "./t3")

# Bad run names and folders (valid ones are above).
BAD_NAMES = (
    "",
    "-a",
    ".a",
    ".checkpointd",
    "a/b",
    "..",
    "../fz-a",
    "/abs",
    "a b",
    "a\x00b",
    "a\nb",
    "fz-a\u202e",
    "fz\u200ba",
    "r\u00e9sum\u00e9",
    "a" * 129,
    "fz-a/",
    "fz-a\\x",
    "\U0001f600",
)

# Planted in the main run's folder before the fuzz (operator-made; clients cannot make links).
PLANTED_DIRS = ("inner",)
PLANTED_LINKS = {  # name -> target (outside: the dir outside the root that must stay empty)
    "escape": "{outside}",
    "inner/up": "{outside_parent}",
    "dangling": "{outside}/not-there",
    "loop": "loop",
    "filelink": "plainfile",
    "insidelink": "p0",
}
PLANTED_FILES = ("plainfile",)

# Export dirs a good save writes (a small pool, so the tree stays small).
GOOD_EXPORT_DIRS = ("p0", "p1", "p2", "nest/p3", "./p4", "p5/", "d\u00e9j\u00e0", "sp ace", "p0/inside")
TRICK_EXPORT_DIRS = (
    "",
    ".",
    "..",
    "../x",
    "a/../../x",
    "a/../../../x",
    "./..",
    "p0/..",
    "/abs",
    "/tmp",
    "//p0",
    "{root}/fz-a/p0",
    "{outside}/x",
    "a\x00b",
    "\x00",
    "a\nb",
    "a\tb",
    "a\x1b[2J",
    "a\x7fb",
    "a\u202eb",
    "\u202e",
    "a\u200bb",
    "\u200b",
    "\ufeffp0",
    "a\u2066b",
    "\ue000",
    "\U000e0001",
    ".checkpointd",
    ".checkpointd-tmp-p0-0123456789abcdef",
    "ok/.checkpointd-old-p0-0123456789abcdef",
    "..\\x",
    "a\\b",
    "x" * 256,
    "x" * 255,
    "x" * 214,
    "x" * 213,
    "\u00e9" * 107,
    "\u00e9" * 106 + "x",
    "x" * 255 + "/p",
    "a/" * 520,
    ("y" * 200 + "/") * 6,
    "escape",
    "escape/p",
    "inner/up/outside/x",
    "inner/up",
    "dangling",
    "dangling/x",
    "loop",
    "loop/x",
    "plainfile",
    "plainfile/x",
    "filelink",
    "filelink/x",
    "insidelink",
    "insidelink/x",
    "p0/saved_model.pb",
    "p0/saved_model.pb/x",
    "p0/variables",
    "p0/checkpointd.manifest.json",
    "p1/" * 3,
)
DTYPES = (
    "float32",
    "float64",
    "int64",
    "bool",
    "bfloat16",
    "float128",
    "complex256",
    "int4",
    "object",
    "O",
    "str",
    "string",
    "resource",
    "variant",
    "U10",
    "V8",
    "<f4",
    ">f4",
    "f4",
    "Float32",
    "float32 ",
    "float32\x00",
    "",
    "\u202efloat32",
)
DIMS = (-1, -(2**63), 0, 1, 2, 3, 4, 16, 2**31, 2**40, 2**62, 2**63 - 1)
SIZES = (0, 1, 7, 2**20, 2**20 + 1, 2**31, 2**40, 2**60, 2**62, 2**63, 2**64 - 1)
TIMEOUTS = (0.0, -1.0, 1e-9, 5e-324, 0.001, 0.5, 3.0, -math.inf, math.nan)
# Huge Flush/CloseRun timeouts (past threading.TIMEOUT_MAX) mean "no deadline";
# they once answered INTERNAL while a save was in flight (an OverflowError):
# test_flush_or_close_with_a_huge_timeout_waits_for_the_save_in_flight.
HUGE_TIMEOUTS = (math.inf, 1e10)


# --- What a scenario is, and what the daemon may answer to it ---


def describe(payload: Any) -> str:
    """A short account of a request (or list of them) for failure messages."""
    if isinstance(payload, (list, tuple)):
        more = ", ..." if len(payload) > 12 else ""
        return "[" + ", ".join(describe(p) for p in payload[:12]) + more + "]"
    if isinstance(payload, bytes):
        return repr(payload[:48])
    if isinstance(payload, pb.Chunk):
        ok = "ok" if crc32c.crc32c(payload.data) == payload.crc32c else "BAD-CRC"
        where = f"path={payload.path[:60]!r}, offset={payload.offset}"
        return f"chunk({where}, len={len(payload.data)}, crc {ok})"
    if isinstance(payload, (pb.SaveRequest, pb.RegisterRunRequest)):
        which = payload.WhichOneof("item")
        return describe(getattr(payload, which)) if which else "<empty request>"
    if isinstance(payload, pb_message.Message):
        fields = []
        for f, value in payload.ListFields():
            if f.name == "variables":
                value = [f"{v.key[:40]}:{v.dtype[:12]}{list(v.shape)[:4]}" for v in value]
            elif isinstance(value, bytes):
                value = f"<{len(value)} bytes>"
            elif isinstance(value, pb_message.Message):
                value = describe(value)
            fields.append(f"{f.name}={value!r:.200}")
        return f"{type(payload).__name__}({', '.join(fields)})"
    return repr(payload)[:200]


class Scenario:
    """One fuzzed request (or a short fixed sequence of them) and what it may get.

    A plain class so that hypothesis reports it by its short `repr`.

    Attributes:
        category: for the histogram.
        rpc: which method; `raw:<Method>` sends `payload` as undecoded bytes.
        payload: the request message(s).
        internal: why INTERNAL would be a correct answer here (the errors table's
            SaveFailedError, or gRPC's own answer to bytes that do not parse);
            None: INTERNAL is a failure.
        known_bug: the xfail test of a known product bug this input meets; its
            INTERNAL is tallied under that name instead of failing the fuzz.
        exact: the one code the daemon must answer, when the scenario knows it.
        expect_ok_path: for a save expected to be written: where.
        reported_skips: (run, n): the request reports n saves its trainer skipped
            on its own (local_skips) that the daemon counts in the run's
            saves_skipped, as the contract says: a Save's once its header
            decodes and names a registered run, refused or not; a Flush's once
            its run is registered, before the wait.
        also: codes beyond the errors table's usual ones this request may
            get (ALREADY_EXISTS for a claimed checkpoint dir).
    """

    def __init__(
        self,
        category: str,
        rpc: str,
        payload: Any,
        internal: str | None = None,
        exact: Code | None = None,
        expect_ok_path: str | None = None,
        known_bug: str | None = None,
        reported_skips: tuple[str, int] | None = None,
    ) -> None:
        self.category, self.rpc, self.payload = category, rpc, payload
        self.internal, self.exact, self.expect_ok_path = internal, exact, expect_ok_path
        self.known_bug = known_bug
        self.reported_skips = reported_skips
        self.also: frozenset[Code] = frozenset()

    def __repr__(self) -> str:
        return f"Scenario({self.category}, {self.rpc}: {describe(self.payload)})"


# --- The fixture the scenarios are built from ---


class World:
    """Fixed facts the strategies build requests from (paths, the template, good bytes).

    A plain class, not a dataclass: hypothesis prints dataclasses field by
    field in every failure report, and this one holds a whole template.
    """

    def __init__(
        self,
        *,
        root: Path,
        outside: Path,
        template: Template,
        variables: tuple[pb.Variable, ...],
        graph: bytes,
        nbytes: int,
        step: int,
        good_chunks: tuple[pb.Chunk, ...],
        template_chunks: tuple[pb.Chunk, ...],
        template_bytes: int,
        training: tuple[pb.TrainingCheckpoint, tuple[pb.Chunk, ...], int] | None = None,
    ) -> None:
        self.root, self.outside, self.template = root, outside, template
        self.variables, self.graph, self.nbytes, self.step = variables, graph, nbytes, step
        self.good_chunks, self.template_chunks = good_chunks, template_chunks
        self.template_bytes = template_bytes
        self.training = training or training_checkpoint()

    def __repr__(self) -> str:  # hypothesis prints the strategies that hold it
        return f"World({self.root})"

    def fill(self, text: str) -> str:
        return text.format(root=self.root, outside=self.outside, outside_parent=self.outside.parent)


def crc_chunk(data: bytes, offset: int, path: str = "") -> pb.Chunk:
    return pb.Chunk(path=path, offset=offset, data=data, crc32c=crc32c.crc32c(data))


def numpy_graph(keys: Sequence[str], attribute: str = "py_state") -> bytes:
    """A TrackableObjectGraph shaped like tf.train.Checkpoint(numpy_arrays=state)'s."""
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    root = graph.nodes.add()
    arrays = graph.nodes.add()
    root.children.add(node_id=1, local_name="numpy_arrays")
    for i, key in enumerate(keys):
        arrays.children.add(node_id=2 + i, local_name=f"a{i}")
        node = graph.nodes.add()
        node.attributes.add(name=attribute, full_name=key, checkpoint_key=key)
    return graph.SerializeToString()


def training_checkpoint() -> tuple[pb.TrainingCheckpoint, tuple[pb.Chunk, ...], int]:
    """A good training checkpoint: two variables and one Python state, its object graph and chunks.

    Built by hand as TensorFlow's saver lays one out (a root with children
    w, b, s; their attributes VARIABLE_VALUE, VARIABLE_VALUE, py_state).
    max_to_keep stays 0 (keep all): a fuzzed save never retires another.
    """
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    root = graph.nodes.add()
    tensors = [
        ("w", "VARIABLE_VALUE", "float32", [4], 16),
        ("b", "VARIABLE_VALUE", "int64", [2], 16),
        ("s", "py_state", "string", [], 10),
    ]
    for i, (name, attribute, _, _, _) in enumerate(tensors):
        root.children.add(node_id=i + 1, local_name=name)
        graph.nodes.add().attributes.add(
            name=attribute, full_name=name, checkpoint_key=f"{name}/.ATTRIBUTES/{attribute}"
        )
    message = pb.TrainingCheckpoint(
        object_graph=graph.SerializeToString(),
        tensors=[
            pb.Tensor(checkpoint_key=f"{name}/.ATTRIBUTES/{attribute}", dtype=dtype, shape=shape, nbytes=nbytes)
            for name, attribute, dtype, shape, nbytes in tensors
        ],
    )
    payload = bytes(range(32)) + b"\x93NUMPY\x00\x00\x00\x00"
    chunks = tuple(crc_chunk(payload[i : i + 16], i) for i in range(0, len(payload), 16))
    return message, chunks, len(payload)


# --- Strategies and oracles shared by the scenario modules ---


def names(valid: Sequence[str] = ()) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(tuple(valid) or UNKNOWN),
        st.sampled_from(BAD_NAMES),
        st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
        st.text(max_size=40),
    )


def export_dirs(world: World) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(GOOD_EXPORT_DIRS),
        st.sampled_from(TRICK_EXPORT_DIRS).map(world.fill),
        st.text(max_size=30),
        st.lists(st.sampled_from(["..", ".", "p0", "escape", "loop", "a", "", "\u202e"]), min_size=1, max_size=5).map(
            "/".join
        ),
    )


def random_message(cls: type, depth: int, strings: st.SearchStrategy[str] | None = None) -> st.SearchStrategy:
    """Messages of `cls` with a random subset of fields set to random values."""
    strings = (
        strings
        if strings is not None
        else st.one_of(st.sampled_from((MAIN, MAIN_FOLDERED, CLOSED, *REG_POOL, "p0", "")), st.text(max_size=30))
    )
    scalar: dict[int, st.SearchStrategy] = {
        pb_descriptor.FieldDescriptor.TYPE_STRING: strings,
        pb_descriptor.FieldDescriptor.TYPE_BYTES: st.binary(max_size=48),
        pb_descriptor.FieldDescriptor.TYPE_BOOL: st.booleans(),
        pb_descriptor.FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
        pb_descriptor.FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
        pb_descriptor.FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
        pb_descriptor.FieldDescriptor.TYPE_FIXED32: st.integers(0, 2**32 - 1),
        pb_descriptor.FieldDescriptor.TYPE_DOUBLE: st.one_of(st.sampled_from(TIMEOUTS), st.floats(-1e6, 1e6)),
        pb_descriptor.FieldDescriptor.TYPE_ENUM: st.integers(-3, 5),
    }

    @st.composite
    def build(draw: Callable) -> pb_message.Message:
        msg = cls()
        for f in cls.DESCRIPTOR.fields:
            if not draw(st.booleans()):
                continue
            if f.message_type is not None and f.message_type.GetOptions().map_entry:  # e.g. trainer_versions
                key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                if value.type != pb_descriptor.FieldDescriptor.TYPE_MESSAGE:
                    getattr(msg, f.name).update(draw(st.dictionaries(scalar[key.type], scalar[value.type], max_size=3)))
            elif f.type == pb_descriptor.FieldDescriptor.TYPE_MESSAGE:
                if depth <= 0:
                    continue
                sub = random_message(f.message_type._concrete_class, depth - 1, strings)
                if f.label == pb_descriptor.FieldDescriptor.LABEL_REPEATED:
                    getattr(msg, f.name).extend(draw(st.lists(sub, max_size=3)))
                else:
                    getattr(msg, f.name).CopyFrom(draw(sub))
            elif f.label == pb_descriptor.FieldDescriptor.LABEL_REPEATED:
                getattr(msg, f.name).extend(draw(st.lists(scalar[f.type], max_size=4)))
            else:
                setattr(msg, f.name, draw(scalar[f.type]))
        return msg

    return build()


def u64(value: int) -> int:
    """`value` clamped into a uint64 field (mutations stack, so sums can leave the range)."""
    return min(max(value, 0), 2**64 - 1)


def normalized(export_dir: str) -> str:
    return str(PurePosixPath(*[p for p in PurePosixPath(export_dir).parts if p != "."]))


def valid_export_dir(world: World, folder: str, export_dir: str) -> bool:
    """The daemon's export dir rules, restated independently for the oracle."""
    if not export_dir or len(export_dir.encode("utf-8")) > 1024 or "\\" in export_dir:
        return False
    if any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn") for c in export_dir):
        return False
    path = PurePosixPath(export_dir)
    parts = [p for p in path.parts if p != "."]
    if path.is_absolute() or not parts:
        return False
    if any(p == ".." or p.startswith(".checkpointd") or len(p.encode()) > 255 for p in parts):
        return False
    if len(parts[-1].encode()) > 213:  # room for ".checkpointd-tmp-retired-<name>-<16 hex>" in 255
        return False
    run_dir = Path(os.path.realpath(world.root / folder))
    real = Path(os.path.realpath(run_dir / PurePosixPath(*parts)))
    return real == run_dir / PurePosixPath(*parts) or run_dir in real.parents


def collides(root: Path, folder: str, export_dir: str) -> bool:
    """True if the export dir, or a parent of it in the folder, is a non-directory.

    Publishing there fails with SaveFailedError (INTERNAL by the errors table):
    the README's "an accepted save could not be written (the message has the
    OS reason)". Which entries are files, loops and links is the fuzz's own doing.
    """
    try:
        parts = [p for p in PurePosixPath(export_dir).parts if p != "."]
    except ValueError:
        return False
    path = root / folder
    for part in parts:
        path = path / part
        if os.path.lexists(path) and (path.is_symlink() or not path.is_dir()):
            return True
        if not os.path.lexists(path):
            return False
    return False
