"""Fuzzed saves that do not send every byte: incremental saves against a base, shared memory, held saves.

What the client may send after the accept depends on the accept (a base's
digests, a segment and its lock), so these scenarios draw a plan and the
harness (fuzz_sequences.py) builds the requests, and the code they must get,
once it has the decision. The training run `BIG_TRAINING` saves one tensor
of exactly one chunk (1 MiB, the fuzz daemon's --max-snapshot-bytes), the
least the daemon offers a base for; the policy saves are smaller, so an
incremental one is never offered a base.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st
from tensorflow.core.protobuf import trackable_object_graph_pb2

from checkpointd.v1 import checkpointd_pb2 as pb
from tests.integration.support.fuzz.fuzz_world import BIG_TRAINING, MAIN, MAIN_FOLDERED, MAX_SNAPSHOT, Scenario, World

BIG_DIRS = ("b0", "b1")
BIG_KEY = "w/.ATTRIBUTES/VARIABLE_VALUE"
BIG_PAYLOAD = bytes(range(256)) * (MAX_SNAPSHOT // 256)  # one float32 tensor of 262,144 values
BIG_CHUNK = 256 << 10  # what the harness sends it in: 4 chunks

# After an accept of an incremental save: how the payload goes.
INCREMENTAL_PLANS = (
    "chunks",  # every byte, ignoring any base
    "same-all",  # one SameChunks for the whole payload
    "same-bad-crc",
    "same-offset",  # not where the payload is
    "same-past-end",
    "same-twice",
    "same-then-chunk",
    "same-no-crc",  # the range without its digests
    "chunk-then-same",
)
# After a shared-memory request's accept.
SHM_PLANS = ("written", "written-then-chunk", "written-twice", "chunks-instead", "written-unoffered")
# A save whose "not skipped" the fuzzer decides itself under the run's busy lock.
HELD_PLANS = ("held", "held-bogus-lock", "held-blocking", "held-empty-paths", "held-unlocked")


def big_checkpoint() -> pb.TrainingCheckpoint:
    """A training checkpoint of one float32 tensor of exactly one chunk (a base can cover it)."""
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.nodes.add().children.add(node_id=1, local_name="w")
    graph.nodes.add().attributes.add(name="VARIABLE_VALUE", full_name="w", checkpoint_key=BIG_KEY)
    tensor = pb.Tensor(checkpoint_key=BIG_KEY, dtype="float32", shape=[len(BIG_PAYLOAD) // 4], nbytes=len(BIG_PAYLOAD))
    return pb.TrainingCheckpoint(object_graph=graph.SerializeToString(), tensors=[tensor])


def policy_header(world: World, run: str, export_dir: str, step: int) -> pb.SaveHeader:
    return pb.SaveHeader(
        run=run,
        kind=pb.SAVED_MODEL,
        export_dir=export_dir,
        step=step,
        variables=world.variables,
        snapshot_bytes=world.nbytes,
    )


@st.composite
def incremental_scenarios(draw: Callable, world: World) -> Scenario:
    """An incremental save: of the big training run (mostly offered a base), or of a policy (never)."""
    which = draw(st.sampled_from(["big", "big", "big", "policy"]))
    # Weighted to the plans that commit: a base is offered only once its dir holds a save.
    plan = draw(st.sampled_from(("chunks", "chunks", "same-all", "same-all", *INCREMENTAL_PLANS)))
    if which == "big":
        header = pb.SaveHeader(
            run=BIG_TRAINING,
            kind=pb.TRAINING_CHECKPOINT,
            export_dir=draw(st.sampled_from((BIG_DIRS[0], *BIG_DIRS))),
            step=draw(st.integers(0, 5)),  # max_to_keep 0 keeps all: few steps keep the tree small
            snapshot_bytes=len(BIG_PAYLOAD),
            training_checkpoint=big_checkpoint(),
        )
    else:
        run = draw(st.sampled_from([MAIN, MAIN_FOLDERED]))
        header = policy_header(world, run, draw(st.sampled_from(["p1", "p2"])), draw(st.integers(0, 10**6)))
        header.kind = draw(st.sampled_from([pb.SAVED_MODEL, pb.CHECKPOINT]))
    header.incremental = True
    header.blocking = draw(st.booleans())
    return Scenario(f"incremental/{which}/{plan}", "incremental", (header, plan))


@st.composite
def shared_memory_scenarios(draw: Callable, world: World) -> Scenario:
    """A policy save that asks for the run's shared-memory segment, then uses (or misuses) it."""
    plan = draw(st.sampled_from(SHM_PLANS))
    header = policy_header(world, MAIN, draw(st.sampled_from(["p1", "p2", "nest/p3"])), draw(st.integers(0, 10**6)))
    header.kind = draw(st.sampled_from([pb.SAVED_MODEL, pb.CHECKPOINT]))
    header.shared_memory = plan != "written-unoffered"
    header.blocking = draw(st.booleans())
    header.on_notice = header.blocking and draw(st.booleans())  # a trainer's last save before it stops
    if header.on_notice:
        header.notice_unix_seconds = draw(st.sampled_from([0.0, 1.7e9, -1.0]))
    return Scenario(f"shm/{plan}", "shm", (header, plan))


@st.composite
def held_scenarios(draw: Callable, world: World) -> Scenario:
    """A save decided under the busy lock (HeldSave), after an ordinary one that learned the lock."""
    plan = draw(st.sampled_from(HELD_PLANS))
    header = policy_header(world, MAIN, draw(st.sampled_from(["p1", "p2"])), draw(st.integers(0, 10**6)))
    return Scenario(f"held/{plan}", "held", (header, plan))
