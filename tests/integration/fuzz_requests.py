"""What the fuzz sends: hypothesis strategies for hostile checkpointd requests.

Each strategy draws a `Scenario`: one request (or a short fixed sequence),
built from a request the daemon would accept and then broken, plus what the
daemon may answer to it where the scenario can know: the exact code (for
example the code the daemon's chunk checks give a broken snapshot stream,
restated here by `chunk_oracle`), whether INTERNAL is justified and why, and
which known product bug (an xfail test in test_fuzz.py) an input meets.
The harness that sends scenarios and judges the answers is in test_fuzz.py.
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
from tests.integration.raw import Template

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
    ) -> None:
        self.category, self.rpc, self.payload = category, rpc, payload
        self.internal, self.exact, self.expect_ok_path = internal, exact, expect_ok_path
        self.known_bug = known_bug

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


# --- Strategies ---


def _names(valid: Sequence[str] = ()) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(tuple(valid) or UNKNOWN),
        st.sampled_from(BAD_NAMES),
        st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
        st.text(max_size=40),
    )


def _export_dirs(world: World) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(GOOD_EXPORT_DIRS),
        st.sampled_from(TRICK_EXPORT_DIRS).map(world.fill),
        st.text(max_size=30),
        st.lists(st.sampled_from(["..", ".", "p0", "escape", "loop", "a", "", "\u202e"]), min_size=1, max_size=5).map(
            "/".join
        ),
    )


def _variable_mutation(variables: list[pb.Variable], draw: Callable) -> None:
    i = draw(st.integers(0, max(0, len(variables) - 1)))
    what = draw(
        st.sampled_from(["key", "checkpoint_key", "dtype", "shape", "drop", "duplicate", "reverse", "append", "clear"])
    )
    if not variables:
        what = "append"
    v = variables[i] if variables else None
    if what == "key":
        v.key = draw(st.one_of(st.text(max_size=40), st.sampled_from([variables[0].key, ""])))
    elif what == "checkpoint_key":
        v.checkpoint_key = draw(st.text(max_size=40))
    elif what == "dtype":
        v.dtype = draw(st.one_of(st.sampled_from(DTYPES), st.text(max_size=12)))
    elif what == "shape":
        dims = draw(st.lists(st.one_of(st.sampled_from(DIMS), st.integers(-(2**63), 2**63 - 1)), max_size=6))
        del v.shape[:]
        v.shape.extend(dims)
    elif what == "drop":
        variables.pop(i)
    elif what == "duplicate":
        variables.insert(i, pb.Variable.FromString(v.SerializeToString()))
    elif what == "reverse":
        variables.reverse()
    elif what == "append":
        variables.append(
            pb.Variable(
                key=draw(st.text(max_size=20)),
                checkpoint_key=draw(st.text(max_size=20)),
                dtype=draw(st.sampled_from(DTYPES)),
                shape=draw(st.lists(st.sampled_from(DIMS), max_size=3)),
            )
        )
    else:
        variables.clear()


def _numpy_state(draw: Callable, world: World) -> tuple[pb.NumpyState, int, bool]:
    """A header's numpy state: (message, its declared bytes, whether it is well formed)."""
    shape = draw(st.sampled_from(["valid", "garbage-graph", "wrong-attribute", "bad-keys", "empty"]))
    n = draw(st.integers(0, 3))
    keys = [f"numpy_arrays/a{i}/.ATTRIBUTES/py_state" for i in range(n)]
    sizes = [draw(st.one_of(st.sampled_from([0, 1, 16, 100]), st.sampled_from(SIZES))) for _ in keys]
    graph = numpy_graph(keys)
    ok = True
    if shape == "garbage-graph":
        graph, ok = draw(st.binary(max_size=64)), False
    elif shape == "wrong-attribute":
        graph, ok = numpy_graph(keys, attribute="VARIABLE_VALUE"), not keys
    elif shape == "bad-keys":
        keys = [draw(st.text(max_size=30)) for _ in keys] + ([keys[0]] if keys else [])
        sizes = sizes + [1] * (len(keys) - len(sizes))
        ok = False
    elif shape == "empty":
        graph, ok = b"", False
    state = pb.NumpyState(
        object_graph=graph,
        entries=[pb.NumpyStateEntry(checkpoint_key=k, nbytes=s) for k, s in zip(keys, sizes, strict=False)],
    )
    return state, sum(sizes), ok


def _chunk_stream(draw: Callable, chunks: list[pb.Chunk], total: int) -> tuple[list[pb.SaveRequest], str]:
    """A snapshot's chunks, maybe broken; returns the requests after the header and what broke."""
    what = draw(
        st.sampled_from(
            [
                "good",
                "good",
                "bad-crc",
                "offset",
                "reorder",
                "truncate",
                "drop-middle",
                "extra",
                "garbage-same-size",
                "garbage-any-size",
                "empty-chunks",
                "duplicate",
                "header-again",
                "huge-offset",
                "with-path",
                "nothing",
                "one-big-chunk",
                "random-chunks",
            ]
        )
    )
    chunks = [pb.Chunk.FromString(c.SerializeToString()) for c in chunks]
    i = draw(st.integers(0, max(0, len(chunks) - 1)))
    extra: list[pb.SaveRequest] = []
    if what == "bad-crc" and chunks:
        chunks[i].crc32c ^= draw(st.integers(1, 2**32 - 1))
    elif what == "offset" and chunks:
        chunks[i].offset = draw(st.sampled_from(SIZES))
    elif what == "reorder" and len(chunks) > 1:
        chunks[i], chunks[-1 - i] = chunks[-1 - i], chunks[i]
    elif what == "truncate":
        chunks = chunks[:i]
    elif what == "drop-middle" and chunks:
        chunks.pop(i)
    elif what == "extra":
        data = draw(st.binary(min_size=1, max_size=64))
        chunks.append(crc_chunk(data, total))
    elif what == "garbage-same-size":
        chunks = [crc_chunk(draw(st.binary(min_size=len(c.data), max_size=len(c.data))), c.offset) for c in chunks]
    elif what == "garbage-any-size":
        data = draw(st.binary(max_size=2 * total + 8))
        chunks = [crc_chunk(data, 0)]
    elif what == "empty-chunks":
        chunks.insert(i, crc_chunk(b"", chunks[i].offset if chunks else 0))
    elif what == "duplicate" and chunks:
        chunks.insert(i, chunks[i])
    elif what == "huge-offset" and chunks:
        chunks[i].offset = 2**64 - 1
    elif what == "with-path" and chunks:
        chunks[i].path = draw(st.sampled_from(["../x", "/etc/passwd", "saved_model.pb"]))
    elif what == "nothing":
        chunks = []
    elif what == "one-big-chunk":
        data = b"".join(c.data for c in chunks)
        chunks = [crc_chunk(data, 0)] if data else []
    elif what == "random-chunks":
        chunks = draw(st.lists(_proto(pb.Chunk, 0), max_size=4))
    requests = [pb.SaveRequest(chunk=c) for c in chunks]
    if what == "header-again":
        again = pb.SaveHeader(run=MAIN, kind=pb.SAVED_MODEL, export_dir="p9")
        requests.insert(i, pb.SaveRequest(header=again))
    return requests + extra, what


def chunk_oracle(requests: Sequence[pb.SaveRequest], total: int) -> Code:
    """The code the daemon's snapshot checks give these requests after an accept."""
    received = 0
    for r in requests:
        if r.WhichOneof("item") != "chunk":
            return Code.INVALID_ARGUMENT
        c = r.chunk
        if c.offset != received or c.offset + len(c.data) > total:
            return Code.INVALID_ARGUMENT
        if crc32c.crc32c(c.data) != c.crc32c:
            return Code.DATA_LOSS
        received += len(c.data)
    return Code.OK if received == total else Code.INVALID_ARGUMENT


def _collides(root: Path, folder: str, export_dir: str) -> bool:
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


@st.composite
def save_scenarios(draw: Callable, world: World) -> Scenario:
    # Weighted toward the main runs, so that many saves get past the header
    # and their chunk streams are what is broken.
    pool = draw(st.sampled_from(["main"] * 6 + ["other", "any"]))
    run = draw(
        st.sampled_from([MAIN] * 6 + [MAIN_FOLDERED] * 2 + [CLOSED])
        if pool == "main"
        else st.sampled_from(REG_POOL + CLOSABLE + UNKNOWN)
        if pool == "other"
        else _names([MAIN])
    )
    header = pb.SaveHeader(
        run=MAIN,
        kind=pb.SAVED_MODEL,
        export_dir="p0",
        step=world.step,
        variables=world.variables,
        snapshot_bytes=world.nbytes,
    )
    header.run = run
    header.export_dir = draw(
        st.one_of(st.sampled_from(GOOD_EXPORT_DIRS), st.sampled_from(GOOD_EXPORT_DIRS), _export_dirs(world))
    )
    header.kind = draw(st.sampled_from([pb.SAVED_MODEL] * 4 + [pb.CHECKPOINT] * 3 + [0, 3, 99, -1]))
    header.blocking = draw(st.booleans())
    header.step = draw(st.one_of(st.integers(0, 10**6), st.integers(-(2**63), 2**63 - 1)))
    mutated = []
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2]))):
        what = draw(st.sampled_from(["variables", "snapshot_bytes", "numpy_state"]))
        mutated.append(what)
        if what == "variables":
            variables = list(header.variables)
            _variable_mutation(variables, draw)
            del header.variables[:]
            header.variables.extend(variables)
        elif what == "snapshot_bytes":
            header.snapshot_bytes = draw(
                st.one_of(st.sampled_from(SIZES), st.sampled_from([world.nbytes - 1, world.nbytes + 1]))
            )
    numpy_ok, numpy_bytes = True, 0
    if "numpy_state" in mutated:
        state, numpy_bytes, numpy_ok = _numpy_state(draw, world)
        header.numpy_state.CopyFrom(state)
        if draw(st.booleans()) and world.nbytes + numpy_bytes < 2**64:
            header.snapshot_bytes = world.nbytes + numpy_bytes
    total = header.snapshot_bytes
    chunks = list(world.good_chunks)
    if numpy_bytes and world.nbytes + numpy_bytes <= MAX_SNAPSHOT:
        payload = bytes([draw(st.integers(0, 255))]) * numpy_bytes  # the daemon never parses it
        chunks.append(crc_chunk(payload, world.nbytes))
    after, broke = _chunk_stream(draw, chunks, total)
    requests = [pb.SaveRequest(header=header), *after]
    order = draw(st.sampled_from(["header-first"] * 6 + ["chunk-first", "no-header", "empty"]))
    if order == "chunk-first":
        first = after[:1] or [pb.SaveRequest(chunk=world.good_chunks[0])]
        requests = [*first, pb.SaveRequest(header=header), *after[1:]]
    elif order == "no-header":
        requests = after
    elif order == "empty":
        requests = []

    scenario = Scenario(f"save/{order}/{broke}/{'+'.join(mutated) or 'header-ok'}", "Save", requests)
    folder = {MAIN: MAIN, MAIN_FOLDERED: MAIN_FOLDER}.get(run)
    headed = order == "header-first"
    clean_header = (
        headed
        and folder is not None
        and header.kind in (pb.SAVED_MODEL, pb.CHECKPOINT)
        and (not mutated or mutated == ["numpy_state"] and numpy_ok)
        and total == world.nbytes + numpy_bytes
        and total <= MAX_SNAPSHOT
    )
    if folder is not None and headed and _collides(world.root, folder, header.export_dir):
        scenario.internal = "publishing onto a non-directory: SaveFailedError, INTERNAL by the table"
    if not headed:
        scenario.exact = Code.INVALID_ARGUMENT
    elif clean_header and _valid_export_dir(world, folder, header.export_dir):
        # The lane is idle (the fuzzer waits out every call), so this is accepted.
        code = chunk_oracle(after, total)
        if code is Code.OK and scenario.internal is None:
            scenario.exact = Code.OK
            scenario.expect_ok_path = str(world.root / folder / _normalized(header.export_dir))
        elif code is not Code.OK and scenario.internal is None:
            # (On a collision the daemon opens the save's files at its accept and fails there, INTERNAL,
            # before a broken chunk stream can: either answer is right.)
            scenario.exact = code
    return scenario


_TRAINING_MUTATIONS = (
    "drop-tensor",
    "add-tensor",
    "rename",
    "dtype",
    "nbytes",
    "shape",
    "graph-garbage",
    "graph-extra",
    "py-state-numeric",
    "snapshot_bytes",
    "kind",
    "variables",
    "numpy_state",
    "hours",
    "no-checkpoint",
)


def _training_mutation(header: pb.SaveHeader, draw: Callable) -> bool:
    """Breaks a training header one way (in place); returns whether it is still valid."""
    before = header.SerializeToString(deterministic=True)
    valid = _break_training(header, draw)
    return valid or header.SerializeToString(deterministic=True) == before  # drew what was there


def _break_training(header: pb.SaveHeader, draw: Callable) -> bool:
    what = draw(st.sampled_from(_TRAINING_MUTATIONS))
    t = header.training_checkpoint
    i = draw(st.integers(0, len(t.tensors) - 1)) if t.tensors else 0
    if what == "drop-tensor" and t.tensors:
        header.snapshot_bytes -= t.tensors[i].nbytes
        del t.tensors[i]
    elif what == "add-tensor":
        t.tensors.add(checkpoint_key=draw(st.text(max_size=30)), dtype="float32", shape=[1], nbytes=4)
        header.snapshot_bytes += 4
    elif what == "rename" and t.tensors:
        t.tensors[i].checkpoint_key = draw(st.one_of(st.text(max_size=30), st.just(t.tensors[-1].checkpoint_key)))
    elif what == "dtype" and t.tensors:
        t.tensors[i].dtype = draw(st.one_of(st.sampled_from(DTYPES), st.text(max_size=12)))
    elif what == "nbytes" and t.tensors:
        t.tensors[i].nbytes = draw(st.sampled_from([n for n in SIZES if n != t.tensors[i].nbytes]))
    elif what == "shape" and t.tensors:
        del t.tensors[i].shape[:]
        t.tensors[i].shape.extend(draw(st.lists(st.sampled_from(DIMS), min_size=1, max_size=4)))
    elif what == "graph-garbage":
        t.object_graph = draw(st.binary(max_size=64))
    elif what == "graph-extra":
        try:
            graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(t.object_graph)
        except pb_message.DecodeError:
            graph = trackable_object_graph_pb2.TrackableObjectGraph()  # an earlier mutation made garbage
        node = graph.nodes[0] if graph.nodes else graph.nodes.add()
        node.attributes.add(name="VARIABLE_VALUE", checkpoint_key=draw(st.text(min_size=1, max_size=20)))
        t.object_graph = graph.SerializeToString()
    elif what == "py-state-numeric" and t.tensors:
        s = t.tensors[-1]
        if s.dtype == "string":
            header.snapshot_bytes += 4 - s.nbytes
            s.dtype, s.nbytes = "float32", 4
            s.shape[:] = [1]
    elif what == "snapshot_bytes":
        header.snapshot_bytes = draw(st.sampled_from([n for n in SIZES if n != header.snapshot_bytes]))
    elif what == "kind":
        header.kind = draw(st.sampled_from([pb.SAVED_MODEL, pb.CHECKPOINT, 0, 99]))
    elif what == "variables":
        header.variables.add(key="k", checkpoint_key="k", dtype="float32", shape=[1])
    elif what == "numpy_state":
        header.numpy_state.CopyFrom(pb.NumpyState(object_graph=numpy_graph([])))
    elif what == "hours":
        t.keep_checkpoint_every_n_hours = draw(st.sampled_from([0.5, 1e-9, 1e300, 0.0, -1.0, math.nan, math.inf]))
        hours = t.keep_checkpoint_every_n_hours
        return hours == 0 or (math.isfinite(hours) and hours > 0)
    elif what == "no-checkpoint":
        header.ClearField("training_checkpoint")
    else:
        return True  # nothing to break in this header
    return False


@st.composite
def training_scenarios(draw: Callable, world: World) -> Scenario:
    """A training run's save: a good header and payload, maybe broken, into a few dirs."""
    message, chunks, total = world.training
    header = pb.SaveHeader(
        run=MAIN_TRAINING,
        kind=pb.TRAINING_CHECKPOINT,
        export_dir=draw(st.one_of(st.sampled_from(TRAINING_DIRS), st.sampled_from(TRAINING_DIRS), _export_dirs(world))),
        blocking=draw(st.booleans()),
        step=draw(st.one_of(st.integers(0, 50), st.integers(0, 50), st.integers(-(2**63), 2**63 - 1))),
        snapshot_bytes=total,
        training_checkpoint=message,
    )
    valid, mutated = True, []
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2]))):
        ok = _training_mutation(header, draw)
        mutated.append("ok" if ok else "broken")
        valid = valid and ok
    after, broke = _chunk_stream(draw, list(chunks), header.snapshot_bytes)
    scenario = Scenario(
        f"train/{broke}/{'+'.join(mutated) or 'header-ok'}", "Save", [pb.SaveRequest(header=header), *after]
    )
    prefix = f"{header.export_dir}/ckpt-{header.step}"
    if not (header.step >= 0 and _valid_export_dir(world, MAIN_TRAINING, header.export_dir)):
        valid = False
    if valid and not _valid_export_dir(world, MAIN_TRAINING, prefix):
        valid = False
    if not valid:
        scenario.exact = Code.INVALID_ARGUMENT
    elif _collides(world.root, MAIN_TRAINING, header.export_dir) or _collides(world.root, MAIN_TRAINING, prefix):
        scenario.internal = "a checkpoint dir through a file: SaveFailedError, INTERNAL by the table"
    else:
        scenario.exact = chunk_oracle(after, total)
        if scenario.exact is Code.OK:
            scenario.expect_ok_path = str(world.root / MAIN_TRAINING / _normalized(prefix))
    return scenario


def _normalized(export_dir: str) -> str:
    return str(PurePosixPath(*[p for p in PurePosixPath(export_dir).parts if p != "."]))


def _valid_export_dir(world: World, folder: str, export_dir: str) -> bool:
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


@st.composite
def register_scenarios(draw: Callable, world: World) -> Scenario:
    run = draw(st.one_of(st.sampled_from(REG_POOL), _names(REG_POOL)))
    header = pb.RegisterRunHeader(
        run=run,
        variables=world.variables,
        checkpoint_object_graph=world.graph,
        template_bytes=world.template_bytes,
    )
    chunks = [pb.Chunk.FromString(c.SerializeToString()) for c in world.template_chunks]
    mutated = []
    for _ in range(draw(st.integers(1, 3))):
        what = draw(
            st.sampled_from(
                [
                    "folder",
                    "template_bytes",
                    "variables",
                    "graph",
                    "path",
                    "extra-file",
                    "many-files",
                    "file-under-file",
                    "duplicate-file",
                    "drop-file",
                    "bad-crc",
                    "offset",
                    "truncate",
                    "garbage-file",
                    "header-again",
                    "chunk-first",
                    "nothing",
                ]
            )
        )
        mutated.append(what)
        i = draw(st.integers(0, len(chunks) - 1)) if chunks else 0
        if what == "folder":
            header.folder = draw(
                st.one_of(
                    st.sampled_from([MAIN, MAIN_FOLDER, "fz-shared", ".checkpointd", "templates"]),
                    st.sampled_from(BAD_NAMES),
                )
            )
        elif what == "template_bytes":
            header.template_bytes = draw(
                st.one_of(
                    st.sampled_from(SIZES),
                    st.sampled_from([world.template_bytes - 1, world.template_bytes + 1, MAX_TEMPLATE + 1]),
                )
            )
        elif what == "variables":
            variables = list(header.variables)
            _variable_mutation(variables, draw)
            del header.variables[:]
            header.variables.extend(variables)
        elif what == "graph":
            header.checkpoint_object_graph = draw(
                st.one_of(st.binary(max_size=64), st.just(b""), st.just(world.graph[: len(world.graph) // 2]))
            )
        elif what == "path" and chunks:
            trick = draw(st.one_of(st.sampled_from(TRICK_EXPORT_DIRS).map(world.fill), st.text(max_size=30)))
            chunks[i].path = trick
        elif what in ("extra-file", "file-under-file"):
            path = draw(_export_dirs(world)) if what == "extra-file" else "saved_model.pb/x"
            data = draw(st.binary(max_size=32))
            chunks.append(crc_chunk(data, 0, path))
            header.template_bytes = _u64(header.template_bytes + len(data))
        elif what == "many-files":
            for k in range(draw(st.integers(50, 400))):
                chunks.append(crc_chunk(b"x", 0, f"assets/many/f{k:04d}"))
            header.template_bytes = sum(len(c.data) for c in chunks)
        elif what == "duplicate-file" and chunks:
            chunks.append(chunks[i])
            header.template_bytes = _u64(header.template_bytes + len(chunks[i].data))
        elif what == "drop-file" and chunks:
            header.template_bytes = _u64(header.template_bytes - len(chunks[i].data))
            chunks.pop(i)
        elif what == "bad-crc" and chunks:
            chunks[i].crc32c ^= 1
        elif what == "offset" and chunks:
            chunks[i].offset = draw(st.sampled_from(SIZES[1:]))
        elif what == "truncate":
            chunks = chunks[:i]
        elif what == "garbage-file" and chunks:
            data = draw(st.binary(max_size=len(chunks[i].data) + 16))
            header.template_bytes = _u64(header.template_bytes + len(data) - len(chunks[i].data))
            chunks[i] = crc_chunk(data, chunks[i].offset, chunks[i].path)
        elif what == "nothing":
            chunks = []
    requests = [pb.RegisterRunRequest(header=header)] + [pb.RegisterRunRequest(chunk=c) for c in chunks]
    exact = None
    if "header-again" in mutated:  # refused when reached; an earlier fault may come first
        requests.insert(draw(st.integers(1, len(requests))), pb.RegisterRunRequest(header=header))
    if "chunk-first" in mutated:
        requests = requests[1:] + requests[:1]
        exact = Code.INVALID_ARGUMENT
    scenario = Scenario(f"register/{'+'.join(sorted(set(mutated)))}", "RegisterRun", requests, exact=exact)
    data = [c for c in chunks if c.path == DATA_FILE]
    original = sum(len(c.data) for c in world.template_chunks if c.path == DATA_FILE)
    if len(data) == 1 and len(data[0].data) < original:
        scenario.known_bug = "test_template_with_a_short_variables_data_file_is_invalid"
    if _file_under_a_file([c.path for c in chunks]):
        scenario.known_bug = "test_template_file_under_another_file_is_invalid"
    return scenario


def _u64(value: int) -> int:
    """`value` clamped into a uint64 field (mutations stack, so sums can leave the range)."""
    return min(max(value, 0), 2**64 - 1)


def _file_under_a_file(paths: Sequence[str]) -> bool:
    """True if a path has an earlier-sent file as one of its parents."""
    files: set[tuple[str, ...]] = set()
    for path in paths:
        parts = tuple(p for p in PurePosixPath(path).parts if p != ".")
        if any(parts[:k] in files for k in range(1, len(parts))):
            return True
        files.add(parts)
    return False


def _proto(cls: type, depth: int, strings: st.SearchStrategy[str] | None = None) -> st.SearchStrategy:
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
            if f.type == pb_descriptor.FieldDescriptor.TYPE_MESSAGE:
                if depth <= 0:
                    continue
                sub = _proto(f.message_type._concrete_class, depth - 1, strings)
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


@st.composite
def random_proto_scenarios(draw: Callable, world: World) -> Scenario:
    rpc = draw(st.sampled_from(["Save", "RegisterRun", "Flush", "GetStatus", "GetLatest", "Restore", "CloseRun"]))
    if rpc == "Save":
        payload = draw(st.lists(_proto(pb.SaveRequest, 3), max_size=5))
    elif rpc == "RegisterRun":
        payload = draw(st.lists(_proto(pb.RegisterRunRequest, 3), max_size=5))
    elif rpc == "CloseRun":  # never a main run: closing one would end its coverage
        runs = st.one_of(st.sampled_from(CLOSABLE), st.text(max_size=20))
        payload = draw(_proto(pb.CloseRunRequest, 1, runs))
    else:
        cls = {
            "Flush": pb.FlushRequest,
            "GetStatus": pb.StatusRequest,
            "GetLatest": pb.LatestRequest,
            "Restore": pb.RestoreRequest,
        }[rpc]
        payload = draw(_proto(cls, 1))
    return Scenario(f"random-proto/{rpc}", rpc, payload)


@st.composite
def unary_scenarios(draw: Callable, world: World) -> Scenario:
    rpc = draw(st.sampled_from(["Flush", "CloseRun", "GetStatus", "GetLatest", "Restore"]))
    runs = st.one_of(st.sampled_from((MAIN, MAIN_FOLDERED, CLOSED, *REG_POOL, *UNKNOWN)), _names())
    if rpc == "Flush":
        payload = pb.FlushRequest(
            run=draw(st.one_of(st.just(""), runs)),
            timeout_seconds=draw(st.sampled_from(TIMEOUTS + HUGE_TIMEOUTS)),
        )
    elif rpc == "CloseRun":
        payload = pb.CloseRunRequest(
            run=draw(st.one_of(st.sampled_from(CLOSABLE), st.sampled_from(UNKNOWN), _names())),
            timeout_seconds=draw(st.sampled_from(TIMEOUTS + HUGE_TIMEOUTS)),
        )
    elif rpc == "GetStatus":
        payload = pb.StatusRequest(run=draw(st.one_of(st.just(""), runs)))
    elif rpc == "GetLatest":
        payload = pb.LatestRequest(
            run=draw(runs),
            kind=draw(st.integers(-1, 4)),
            folder=draw(st.one_of(st.just(""), st.sampled_from((MAIN, MAIN_FOLDER)), _names())),
        )
    else:
        payload = pb.RestoreRequest(run=draw(runs), export_dir=draw(st.one_of(st.just(""), _export_dirs(world))))
    return Scenario(f"unary/{rpc}", rpc, payload)


@st.composite
def raw_scenarios(draw: Callable, world: World) -> Scenario:
    method = draw(st.sampled_from(["Save", "RegisterRun", "Flush", "GetStatus", "CloseRun"]))
    streaming = method in ("Save", "RegisterRun")
    payload = draw(st.lists(st.binary(max_size=96), min_size=1, max_size=4 if streaming else 1))
    request_cls = {
        "Save": pb.SaveRequest,
        "RegisterRun": pb.RegisterRunRequest,
        "Flush": pb.FlushRequest,
        "GetStatus": pb.StatusRequest,
        "CloseRun": pb.CloseRunRequest,
    }[method]
    scenario = Scenario(f"raw-bytes/{method}", f"raw:{method}", payload)
    undecodable = []
    for data in payload:
        try:
            request_cls.FromString(data)
        except pb_message.DecodeError:
            undecodable.append(data)
    if undecodable:
        # grpcio answers INTERNAL "Exception deserializing request!" before any
        # servicer code runs; checkpointd cannot see these bytes.
        scenario.internal = "gRPC could not deserialize the request"
    return scenario


@st.composite
def overlap_scenarios(draw: Callable, world: World) -> Scenario:
    """A request while a save of the main run is held in flight, then the held save ends."""
    second = draw(st.sampled_from(["skip", "blocking-deadline", "flush-run", "flush-all", "status", "checkpoint-skip"]))
    ending = draw(st.sampled_from(["good", "bad-crc", "truncate", "cancel"]))
    timeout = draw(st.sampled_from([t for t in TIMEOUTS if 0 < t < 1] + [-1.0, -math.inf]))
    export_dir = draw(st.sampled_from(["p1", "p2", "nest/p3"]))
    return Scenario(f"overlap/{second}/{ending}", "overlap", (second, ending, timeout, export_dir))


def scenarios(world: World) -> st.SearchStrategy[Scenario]:
    return st.one_of(
        save_scenarios(world),
        save_scenarios(world),
        save_scenarios(world),
        training_scenarios(world),
        register_scenarios(world),
        unary_scenarios(world),
        random_proto_scenarios(world),
        raw_scenarios(world),
        overlap_scenarios(world),
        st.builds(lambda: Scenario("save/cancel-mid-upload", "cancel", None)),
    )
