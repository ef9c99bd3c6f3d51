"""Fuzzed reads: RestoreFiles (ranges, names, sizes, header only, staged), Restore, GetLatest, GetStatus.

The saves they read are whatever the fuzz committed so far, so few codes are
exact here (a request with neither a run nor a folder and export dir, a
staged call); the harness (fuzz_sequences.py) checks every answer that ends
OK against the header it came with: the chunks are the asked ranges in
order, each with a good CRC32C, every file sent whole matches its size and
CRC32C, staged files are where and as big as the header says and are gone
once the call ends.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st

from checkpointd.v1 import checkpointd_pb2 as pb
from tests.integration.support.fuzz.fuzz_incremental import BIG_DIRS
from tests.integration.support.fuzz.fuzz_world import (
    BIG_TRAINING,
    DATA_FILE,
    GOOD_EXPORT_DIRS,
    MAIN,
    MAIN_FOLDER,
    MAIN_FOLDERED,
    MAIN_TRAINING,
    SIZES,
    TRAINING_DIRS,
    UNKNOWN,
    Code,
    Scenario,
    World,
    export_dirs,
    names,
)

READ_RUNS = (MAIN, MAIN_FOLDERED, MAIN_TRAINING, BIG_TRAINING)
READ_FOLDERS = (MAIN, MAIN_FOLDER, MAIN_TRAINING, BIG_TRAINING)
# Names a restore's files have (a policy save's, a training checkpoint's), and near misses.
FILE_NAMES = (
    "variables/variables.index",
    DATA_FILE,
    "numpy_state/numpy_state.index",
    "numpy_state/numpy_state.data-00000-of-00001",
    "ckpt-0.index",
    "ckpt-1.data-00000-of-00001",
    "saved_model.pb",
    "checkpointd.manifest.json",
    "checkpoint",
    "",
    "variables",
    "./variables/variables.index",
    "variables//variables.index",
    "variables/../variables/variables.index",
    "../p1/variables/variables.index",
    "/etc/passwd",
    "variables/variables.index\x00",
)


def _saved_dirs(world: World) -> st.SearchStrategy[str]:
    """Export dirs of saves the fuzz makes (policy dirs, training prefixes), and any other."""
    prefixes = st.builds(
        lambda d, step: f"{d}/ckpt-{step}",
        st.sampled_from(TRAINING_DIRS + BIG_DIRS),
        st.one_of(st.integers(0, 5), st.integers(0, 50), st.integers(-1, 2**63 - 1)),
    )
    return st.one_of(st.just(""), st.sampled_from(GOOD_EXPORT_DIRS), prefixes, export_dirs(world))


def _ranges() -> st.SearchStrategy[list[pb.FileRange]]:
    sizes = st.one_of(st.sampled_from(SIZES), st.integers(0, 5000))
    lengths = st.one_of(st.just(0), st.integers(1, 600), st.sampled_from(SIZES))
    paths = st.one_of(st.sampled_from(FILE_NAMES), st.text(max_size=30))
    return st.lists(st.builds(pb.FileRange, path=paths, offset=sizes, length=lengths), max_size=5)


def _policy_ranges() -> st.SearchStrategy[list[pb.FileRange]]:
    """Ranges of a policy save's real files, mostly inside them: a partial restore."""
    paths = st.sampled_from(["variables/variables.index", DATA_FILE])
    near = st.integers(0, 700)
    return st.lists(st.builds(pb.FileRange, path=paths, offset=near, length=near), min_size=1, max_size=4)


@st.composite
def restore_files_scenarios(draw: Callable, world: World) -> Scenario:
    if draw(st.booleans()):  # a restore a client would ask for: a saved run's newest, or a policy save
        run = draw(st.sampled_from(READ_RUNS))
        policy = run in (MAIN, MAIN_FOLDERED)
        request = pb.RestoreFilesRequest(
            run=run,
            export_dir=draw(st.sampled_from(["", "p0", "p1", "p2"])) if policy else "",
            ranges=draw(st.one_of(st.just([]), _policy_ranges())) if policy else [],
        )
    else:
        run = draw(st.one_of(st.sampled_from(READ_RUNS), st.just(""), st.sampled_from(UNKNOWN), names()))
        request = pb.RestoreFilesRequest(
            run=run,
            export_dir=draw(_saved_dirs(world)),
            folder=draw(st.one_of(st.just(""), st.sampled_from(READ_FOLDERS), names())),
            ranges=draw(st.one_of(st.just([]), _ranges())),
        )
    request.header_only = draw(st.sampled_from([False, False, True]))
    request.stage = draw(st.sampled_from([False, False, True]))
    scenario = Scenario("restore-files/" + ("staged" if request.stage else "sent"), "RestoreFiles", request)
    if not run and not (request.folder and request.export_dir):
        scenario.exact = Code.INVALID_ARGUMENT  # a reader names the folder and the save
    return scenario


@st.composite
def read_scenarios(draw: Callable, world: World) -> Scenario:
    """Restore, GetLatest by checkpoint dir, GetStatus of the store: the other ways a save is read."""
    rpc = draw(st.sampled_from(["Restore", "GetLatest", "GetStatus"]))
    runs = st.one_of(st.sampled_from(READ_RUNS), st.sampled_from(UNKNOWN), names())
    if rpc == "Restore":
        payload = pb.RestoreRequest(run=draw(runs), export_dir=draw(_saved_dirs(world)))
    elif rpc == "GetLatest":
        payload = pb.LatestRequest(
            run=draw(st.one_of(st.just(""), runs)),
            kind=draw(st.sampled_from([0, pb.TRAINING_CHECKPOINT, pb.SAVED_MODEL, 99])),
            folder=draw(st.one_of(st.just(""), st.sampled_from(READ_FOLDERS), names())),
            checkpoint_dir=draw(st.one_of(st.sampled_from(TRAINING_DIRS + BIG_DIRS), export_dirs(world))),
        )
    else:
        payload = pb.StatusRequest(run=draw(st.one_of(st.just(""), runs)), stored=True)
    return Scenario(f"read/{rpc}", rpc, payload)
