"""What the fuzz sends: hypothesis strategies for hostile checkpointd requests.

Each strategy draws a `Scenario` (fuzz_world.py): one request (or a short
fixed sequence), built from a request the daemon would accept and then
broken, plus what the daemon may answer to it where the scenario can know:
the exact code, whether INTERNAL is justified and why, and which known
product bug (a test in test_fuzz.py) an input meets. Saves are drawn in
fuzz_saves.py, restores in fuzz_restores.py, incremental and same-host saves
in fuzz_incremental.py; here are registration, the other RPCs, random
messages of every request type, undecodable bytes, and `scenarios`, the mix.
The harness that sends scenarios and judges the answers is fuzz_harness.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import PurePosixPath

from google.protobuf import message as pb_message
from hypothesis import strategies as st

from checkpointd.v1 import checkpointd_pb2 as pb
from tests.integration.support.fuzz.fuzz_incremental import (
    BIG_DIRS,
    held_scenarios,
    incremental_scenarios,
    shared_memory_scenarios,
)
from tests.integration.support.fuzz.fuzz_restores import read_scenarios, restore_files_scenarios
from tests.integration.support.fuzz.fuzz_saves import (
    local_skip_scenarios,
    mutate_variables,
    save_scenarios,
    training_scenarios,
)
from tests.integration.support.fuzz.fuzz_world import (
    BAD_NAMES,
    BIG_TRAINING,
    CLOSABLE,
    CLOSED,
    COUNTED,
    DATA_FILE,
    HUGE_TIMEOUTS,
    MAIN,
    MAIN_FOLDER,
    MAIN_FOLDERED,
    MAIN_TRAINING,
    MAX_TEMPLATE,
    REG_POOL,
    SIZES,
    TIMEOUTS,
    TRAINING_DIRS,
    TRICK_EXPORT_DIRS,
    UNKNOWN,
    Code,
    Scenario,
    World,
    crc_chunk,
    export_dirs,
    names,
    random_message,
    u64,
)

RPCS = ("Save", "RegisterRun", "Flush", "GetStatus", "GetLatest", "Restore", "RestoreFiles", "CloseRun")
# Registered by the fixture; random registrations go elsewhere.
FIXED_RUNS = (MAIN, MAIN_FOLDERED, CLOSED, *CLOSABLE, MAIN_TRAINING, BIG_TRAINING)


@st.composite
def training_register_scenarios(draw: Callable, world: World) -> Scenario:
    """RegisterRun of a training run: its folder and the checkpoint dir it claims, maybe with what it must not carry."""
    header = pb.RegisterRunHeader(
        run=draw(st.one_of(st.sampled_from(REG_POOL), names(REG_POOL))),
        kind=pb.TRAINING_CHECKPOINT,
        folder=draw(st.one_of(st.just(""), st.sampled_from([MAIN_TRAINING, BIG_TRAINING]), names())),
    )
    if draw(st.booleans()):
        header.checkpoint_dir = draw(st.one_of(st.sampled_from(TRAINING_DIRS + BIG_DIRS), export_dirs(world)))
    extra = draw(st.sampled_from(["none", "none", "none", "variables", "template_bytes", "chunk", "graph"]))
    chunks = []
    if extra == "variables":
        header.variables.extend(world.variables[:1])
    elif extra == "template_bytes":
        header.template_bytes = draw(st.sampled_from([1, 7, MAX_TEMPLATE]))  # past it: RESOURCE_EXHAUSTED first
    elif extra == "graph":
        header.checkpoint_object_graph = draw(st.binary(min_size=1, max_size=32))
    elif extra == "chunk":
        chunks.append(pb.RegisterRunRequest(chunk=crc_chunk(b"x", 0, "saved_model.pb")))
    requests = [pb.RegisterRunRequest(header=header), *chunks]  # a message copies the header
    scenario = Scenario(f"register-training/{extra}", "RegisterRun", requests)
    if extra != "none":
        scenario.exact = Code.INVALID_ARGUMENT
    scenario.also = frozenset({Code.ALREADY_EXISTS})  # another open run of the folder claims the dir
    return scenario


@st.composite
def register_scenarios(draw: Callable, world: World) -> Scenario:
    run = draw(st.one_of(st.sampled_from(REG_POOL), names(REG_POOL)))
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
            mutate_variables(variables, draw)
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
            path = draw(export_dirs(world)) if what == "extra-file" else "saved_model.pb/x"
            data = draw(st.binary(max_size=32))
            chunks.append(crc_chunk(data, 0, path))
            header.template_bytes = u64(header.template_bytes + len(data))
        elif what == "many-files":
            for k in range(draw(st.integers(50, 400))):
                chunks.append(crc_chunk(b"x", 0, f"assets/many/f{k:04d}"))
            header.template_bytes = sum(len(c.data) for c in chunks)
        elif what == "duplicate-file" and chunks:
            chunks.append(chunks[i])
            header.template_bytes = u64(header.template_bytes + len(chunks[i].data))
        elif what == "drop-file" and chunks:
            header.template_bytes = u64(header.template_bytes - len(chunks[i].data))
            chunks.pop(i)
        elif what == "bad-crc" and chunks:
            chunks[i].crc32c ^= 1
        elif what == "offset" and chunks:
            chunks[i].offset = draw(st.sampled_from(SIZES[1:]))
        elif what == "truncate":
            chunks = chunks[:i]
        elif what == "garbage-file" and chunks:
            data = draw(st.binary(max_size=len(chunks[i].data) + 16))
            header.template_bytes = u64(header.template_bytes + len(data) - len(chunks[i].data))
            chunks[i] = crc_chunk(data, chunks[i].offset, chunks[i].path)
        elif what == "nothing":
            chunks = []
    requests = [pb.RegisterRunRequest(header=header)] + [pb.RegisterRunRequest(chunk=c) for c in chunks]
    exact = None
    if "header-again" in mutated:  # refused when reached; an earlier fault may come first
        requests.insert(draw(st.integers(1, len(requests))), pb.RegisterRunRequest(header=header))
    if "chunk-first" in mutated:
        requests = requests[1:] + requests[:1]
        if requests[0].WhichOneof("item") != "header":  # header-again may have put a header first
            exact = Code.INVALID_ARGUMENT
    scenario = Scenario(f"register/{'+'.join(sorted(set(mutated)))}", "RegisterRun", requests, exact=exact)
    # A pool run may be open as another stream (a training run, another folder): one name, one stream.
    scenario.also = frozenset({Code.ALREADY_EXISTS})
    data = [c for c in chunks if c.path == DATA_FILE]
    original = sum(len(c.data) for c in world.template_chunks if c.path == DATA_FILE)
    if len(data) == 1 and len(data[0].data) < original:
        scenario.known_bug = "test_template_with_a_short_variables_data_file_is_invalid"
    if _file_under_a_file([c.path for c in chunks]):
        scenario.known_bug = "test_template_file_under_another_file_is_invalid"
    return scenario


def _file_under_a_file(paths: Sequence[str]) -> bool:
    """True if a path has an earlier-sent file as one of its parents."""
    files: set[tuple[str, ...]] = set()
    for path in paths:
        parts = tuple(p for p in PurePosixPath(path).parts if p != ".")
        if any(parts[:k] in files for k in range(1, len(parts))):
            return True
        files.add(parts)
    return False


@st.composite
def random_proto_scenarios(draw: Callable, world: World) -> Scenario:
    rpc = draw(st.sampled_from(RPCS))
    if rpc == "Save":
        payload = draw(st.lists(random_message(pb.SaveRequest, 3), max_size=5))
    elif rpc == "RegisterRun":
        payload = draw(st.lists(random_message(pb.RegisterRunRequest, 3), max_size=5))
    elif rpc == "CloseRun":  # never a main run: closing one would end its coverage
        runs = st.one_of(st.sampled_from(CLOSABLE), st.text(max_size=20))
        payload = draw(random_message(pb.CloseRunRequest, 1, runs))
    else:
        cls = {
            "Flush": pb.FlushRequest,
            "GetStatus": pb.StatusRequest,
            "GetLatest": pb.LatestRequest,
            "Restore": pb.RestoreRequest,
            "RestoreFiles": pb.RestoreFilesRequest,
        }[rpc]
        payload = draw(random_message(cls, 2))
    for message in payload if isinstance(payload, list) else [payload]:
        _uncounted_skip_reports(message)
        if isinstance(message, pb.RegisterRunRequest) and message.header.run in FIXED_RUNS:
            # A random header may register a training run (it needs nothing
            # else): never over one of the runs the other scenarios rely on.
            message.header.run = REG_POOL[0]
    scenario = Scenario(f"random-proto/{rpc}", rpc, payload)
    if rpc == "RegisterRun":
        scenario.also = frozenset({Code.ALREADY_EXISTS})  # a training run's checkpoint dir, claimed
    return scenario


def _uncounted_skip_reports(message: pb_message.Message) -> None:
    """Moves a random request's skip reports off the runs whose counts the fuzz checks.

    Whether the daemon counts a report depends on every check of the
    header's decoding before its run is looked up (kind, variables, numpy
    state, ...), which a random header meets in any order; the counted runs
    get their reports from `local_skip_scenarios`, whose oracle is exact.
    Here they go to a registered run nobody counts, still through the same path.
    """
    header = message.header if isinstance(message, pb.SaveRequest) and message.HasField("header") else message
    if isinstance(header, (pb.SaveHeader, pb.FlushRequest)) and header.local_skips and header.run in COUNTED:
        header.run = CLOSABLE[0]


@st.composite
def unary_scenarios(draw: Callable, world: World) -> Scenario:
    rpc = draw(st.sampled_from(["Flush", "CloseRun", "GetStatus", "GetLatest", "Restore"]))
    runs = st.one_of(st.sampled_from((MAIN, MAIN_FOLDERED, CLOSED, *REG_POOL, *UNKNOWN)), names())
    if rpc == "Flush":
        payload = pb.FlushRequest(
            run=draw(st.one_of(st.just(""), runs)),
            timeout_seconds=draw(st.sampled_from(TIMEOUTS + HUGE_TIMEOUTS)),
        )
    elif rpc == "CloseRun":
        payload = pb.CloseRunRequest(
            run=draw(st.one_of(st.sampled_from(CLOSABLE), st.sampled_from(UNKNOWN), names())),
            timeout_seconds=draw(st.sampled_from(TIMEOUTS + HUGE_TIMEOUTS)),
        )
    elif rpc == "GetStatus":
        payload = pb.StatusRequest(run=draw(st.one_of(st.just(""), runs)))
    elif rpc == "GetLatest":
        payload = pb.LatestRequest(
            run=draw(runs),
            kind=draw(st.integers(-1, 4)),
            folder=draw(st.one_of(st.just(""), st.sampled_from((MAIN, MAIN_FOLDER)), names())),
        )
    else:
        payload = pb.RestoreRequest(run=draw(runs), export_dir=draw(st.one_of(st.just(""), export_dirs(world))))
    return Scenario(f"unary/{rpc}", rpc, payload)


@st.composite
def raw_scenarios(draw: Callable, world: World) -> Scenario:
    method = draw(st.sampled_from(RPCS))
    streaming = method in ("Save", "RegisterRun")
    payload = draw(st.lists(st.binary(max_size=96), min_size=1, max_size=4 if streaming else 1))
    request_cls = {
        "Save": pb.SaveRequest,
        "RegisterRun": pb.RegisterRunRequest,
        "Flush": pb.FlushRequest,
        "GetStatus": pb.StatusRequest,
        "CloseRun": pb.CloseRunRequest,
        "GetLatest": pb.LatestRequest,
        "Restore": pb.RestoreRequest,
        "RestoreFiles": pb.RestoreFilesRequest,
    }[method]
    scenario = Scenario(f"raw-bytes/{method}", f"raw:{method}", payload)
    undecodable = []
    for data in payload:
        try:
            request_cls.FromString(data)
        except pb_message.DecodeError:
            undecodable.append(data)
    if undecodable and method != "Save":
        # grpcio answers INTERNAL "Exception deserializing request!" before any
        # servicer code runs; checkpointd cannot see these bytes. Save's own
        # deserializer (wire.parse_save_request) hands them on, refused INVALID_ARGUMENT.
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
        local_skip_scenarios(world),
        incremental_scenarios(world),
        incremental_scenarios(world),
        shared_memory_scenarios(world),
        held_scenarios(world),
        restore_files_scenarios(world),
        restore_files_scenarios(world),
        read_scenarios(world),
        training_register_scenarios(world),
        st.builds(lambda: Scenario("save/cancel-mid-upload", "cancel", None)),
    )
