"""Fuzzed saves: policy and training headers broken field by field, and their snapshot streams.

`chunk_oracle` restates the daemon's snapshot checks to give the one code a
broken stream must get after an accept; `local_skip_scenarios` reports saves
a trainer skipped on its own, with the exact count the daemon must add.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import crc32c
from google.protobuf import message as pb_message
from hypothesis import strategies as st
from tensorflow.core.protobuf import trackable_object_graph_pb2

from checkpointd.v1 import checkpointd_pb2 as pb
from tests.integration.support.fuzz.fuzz_world import (
    CLOSABLE,
    CLOSED,
    DIMS,
    DTYPES,
    GOOD_EXPORT_DIRS,
    MAIN,
    MAIN_FOLDER,
    MAIN_FOLDERED,
    MAIN_TRAINING,
    MAX_SNAPSHOT,
    REG_POOL,
    SIZES,
    SKIP_REPORT_VARIANTS,
    TRAINING_DIRS,
    UNKNOWN,
    Code,
    Scenario,
    World,
    collides,
    crc_chunk,
    export_dirs,
    names,
    normalized,
    numpy_graph,
    random_message,
    u64,
    valid_export_dir,
)


def mutate_variables(variables: list[pb.Variable], draw: Callable) -> None:
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
        chunks = draw(st.lists(random_message(pb.Chunk, 0), max_size=4))
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
        else names([MAIN])
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
        st.one_of(st.sampled_from(GOOD_EXPORT_DIRS), st.sampled_from(GOOD_EXPORT_DIRS), export_dirs(world))
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
            mutate_variables(variables, draw)
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
    if folder is not None and headed and collides(world.root, folder, header.export_dir):
        scenario.internal = "publishing onto a non-directory: SaveFailedError, INTERNAL by the table"
    if not headed:
        scenario.exact = Code.INVALID_ARGUMENT
    elif clean_header and valid_export_dir(world, folder, header.export_dir):
        # The lane is idle (the fuzzer waits out every call), so this is accepted.
        code = chunk_oracle(after, total)
        if code is Code.OK and scenario.internal is None:
            scenario.exact = Code.OK
            scenario.expect_ok_path = str(world.root / folder / normalized(header.export_dir))
        elif code is not Code.OK and scenario.internal is None:
            # With a non-directory in the way the write fails (INTERNAL) as soon
            # as the accepted save opens its files, which may come first.
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
    # Sizes are uint64 and mutations stack (an earlier one may have set a
    # size near 0 or 2**64), so every sum is clamped into the field's range.
    if what == "drop-tensor" and t.tensors:
        header.snapshot_bytes = u64(header.snapshot_bytes - t.tensors[i].nbytes)
        del t.tensors[i]
    elif what == "add-tensor":
        t.tensors.add(checkpoint_key=draw(st.text(max_size=30)), dtype="float32", shape=[1], nbytes=4)
        header.snapshot_bytes = u64(header.snapshot_bytes + 4)
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
            header.snapshot_bytes = u64(header.snapshot_bytes + 4 - s.nbytes)
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
        export_dir=draw(st.one_of(st.sampled_from(TRAINING_DIRS), st.sampled_from(TRAINING_DIRS), export_dirs(world))),
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
    if not (header.step >= 0 and valid_export_dir(world, MAIN_TRAINING, header.export_dir)):
        valid = False
    if valid and not valid_export_dir(world, MAIN_TRAINING, prefix):
        valid = False
    if not valid:
        scenario.exact = Code.INVALID_ARGUMENT
    elif collides(world.root, MAIN_TRAINING, header.export_dir) or collides(world.root, MAIN_TRAINING, prefix):
        scenario.internal = "a checkpoint dir through a file: SaveFailedError, INTERNAL by the table"
    else:
        scenario.exact = chunk_oracle(after, total)
        if scenario.exact is Code.OK:
            scenario.expect_ok_path = str(world.root / MAIN_TRAINING / normalized(prefix))
    return scenario


@st.composite
def local_skip_scenarios(draw: Callable, world: World) -> Scenario:
    """Saves and Flushes of a counted run that report saves the trainer skipped under the busy lock."""
    run = draw(st.sampled_from([MAIN, MAIN_FOLDERED]))
    variant = draw(st.sampled_from(SKIP_REPORT_VARIANTS))
    skips = [
        pb.LocalSkip(
            kind=draw(st.sampled_from([pb.SAVED_MODEL, pb.CHECKPOINT, pb.TRAINING_CHECKPOINT])),
            export_dir=draw(st.one_of(st.sampled_from(GOOD_EXPORT_DIRS), st.text(max_size=20))),
            step=draw(st.integers(-(2**63), 2**63 - 1)),
        )
        for _ in range(draw(st.integers(1, 4)))
    ]
    if variant.endswith("bad-skip-kind"):
        skips[-1].kind = draw(st.sampled_from([pb.SAVE_KIND_UNSPECIFIED, 99, -1]))
    counted = (run, len(skips))
    if variant.startswith("flush"):
        request = pb.FlushRequest(run=run, timeout_seconds=draw(st.sampled_from([0.0, 5.0])), local_skips=skips)
        code = Code.OK
        if variant == "flush-no-run":
            request.run, code, counted = "", Code.INVALID_ARGUMENT, None
        elif variant == "flush-unknown-run":
            request.run, code, counted = UNKNOWN[0], Code.NOT_FOUND, None
        elif variant == "flush-nan":  # counted before the wait is even parsed
            request.timeout_seconds, code = math.nan, Code.INVALID_ARGUMENT
        elif variant == "flush-bad-skip-kind":
            code, counted = Code.INVALID_ARGUMENT, None
        return Scenario(f"local-skips/{variant}", "Flush", request, exact=code, reported_skips=counted)
    folder = {MAIN: MAIN, MAIN_FOLDERED: MAIN_FOLDER}[run]
    header = pb.SaveHeader(
        run=run,
        kind=draw(st.sampled_from([pb.SAVED_MODEL, pb.CHECKPOINT])),
        export_dir=draw(st.sampled_from(("p1", "p2", "nest/p3"))),
        step=draw(st.integers(0, 10**6)),
        variables=world.variables,
        snapshot_bytes=world.nbytes,
        local_skips=skips,
    )
    exact: Code | None = Code.INVALID_ARGUMENT
    if variant == "save-bad-export-dir":  # refused after the report is counted
        header.export_dir = draw(st.sampled_from(["", "..", "../x", "/abs", "a\\b", ".checkpointd"]))
    elif variant == "save-wrong-size":
        header.snapshot_bytes = world.nbytes + 1
    elif variant == "save-unknown-run":
        header.run, exact, counted = UNKNOWN[0], Code.NOT_FOUND, None
    elif variant == "save-bad-kind":  # the header does not decode: nothing is counted
        header.kind, counted = draw(st.sampled_from([pb.SAVE_KIND_UNSPECIFIED, 99])), None
    elif variant == "save-bad-skip-kind":
        counted = None
    else:  # a good save: the lane is idle, so it is accepted and written
        exact = Code.OK
    requests = [pb.SaveRequest(header=header), *(pb.SaveRequest(chunk=c) for c in world.good_chunks)]
    scenario = Scenario(f"local-skips/{variant}", "Save", requests, exact=exact, reported_skips=counted)
    if collides(world.root, folder, header.export_dir):
        scenario.exact = None if exact is Code.OK else exact
        scenario.internal = "publishing onto a non-directory: SaveFailedError, INTERNAL by the table"
    elif exact is Code.OK:
        scenario.expect_ok_path = str(world.root / folder / header.export_dir)
    return scenario
