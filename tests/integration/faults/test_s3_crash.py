"""Crash consistency on S3: SIGKILL of the daemon during uploads and commits, against radosgw.

A short subset of `tests.integration.support.s3_crash_harness` (read its docstring
for what each trial does and checks): CHECKPOINTD_CRASH_TRIALS trials,
default 2, with the large policy and training state, whose variables go up
in two multipart parts; CHECKPOINTD_FUZZ_SEED picks another seeded sequence
of kill moments (default 0). The long mode, at least 50 trials, prints the
kills per phase:

    python -m tests.integration.support.s3_crash_harness --trials 50
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tests.integration.support import s3_bucket, s3_crash_harness
from tests.integration.support.rgw import Rgw

TRIALS = int(os.environ.get("CHECKPOINTD_CRASH_TRIALS", "2"))
SEED = int(os.environ.get("CHECKPOINTD_FUZZ_SEED", "0"))


def test_kill_9_during_s3_uploads_and_commits_leaves_only_whole_saves_and_recovery_cleans_the_rest(
    rgw: Rgw,
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    figures = s3_crash_harness.run_trials(TRIALS, rgw, tmp_path, size="large", seed=SEED)
    record_property("s3_crash_figures", figures.summary())
    print(figures.summary())  # shown with -s; the long mode prints the same line
    assert figures.failures == [], "\n".join(figures.failures)
    assert figures.trials == TRIALS
    assert sum(n for phase, n in figures.kills.items() if phase.startswith("policy ")) == TRIALS
    assert sum(n for phase, n in figures.kills.items() if phase.startswith("training ")) == TRIALS
    assert figures.saves_durable > 0 and figures.save_checks > 0 and figures.loads > 0
    assert figures.bytes_copied > 0  # the training run's checkpoints were incremental (copied in the bucket)
    # The kills cut uploads short, so recovery had objects or multipart uploads to clean (and did).
    assert figures.leftover_objects + figures.leftover_uploads > 0


class _FakeReader:
    """Reads back bytes from a dict instead of the bucket."""

    def __init__(self, data: dict[str, bytes]) -> None:
        self.data = data

    def head(self, key: str) -> None:
        return None  # the listing is the truth here

    def crc(self, key: str, etag: str) -> tuple[int, int]:
        import crc32c

        return len(self.data[key]), crc32c.crc32c(self.data[key])


def test_the_bucket_checks_catch_a_torn_commit_and_name_each_phase() -> None:
    """The checks the trials rely on fail where they must: on bucket states a broken commit would leave."""
    import crc32c

    data = {"p/run/sm/saved_model.pb": b"graph", "p/run/sm/variables/variables.data-00000-of-00001": b"weights"}
    manifest = {
        "step": 3,
        "files": [{"path": k[len("p/run/sm/") :], "size": len(v), "crc32c": f"{crc32c.crc32c(v):08x}"} for k, v in data.items()],
        "s3_etags": {k[len("p/run/sm/") :]: f"e{i}" for i, k in enumerate(data)},
    }  # fmt: skip
    objects = {k: (len(data[k]), f"e{i}", 0.0) for i, k in enumerate(data)}
    key = f"p/run/sm/{s3_bucket.MANIFEST}"

    def problems(objects: dict[str, tuple[int, str, float]], stored: dict[str, bytes]) -> list[str]:
        bucket = s3_bucket.Bucket(objects, [], {key: manifest})
        return s3_bucket.check_manifests(bucket, _FakeReader(stored))  # type: ignore[arg-type]

    assert problems(objects, data) == []
    missing = dict(objects)
    del missing["p/run/sm/saved_model.pb"]
    assert "which is not in the bucket" in problems(missing, data)[0]
    rewritten = {**objects, "p/run/sm/saved_model.pb": (5, "other", 0.0)}  # a later writer's object
    assert "ETag other" in problems(rewritten, data)[0]
    flipped = {**data, "p/run/sm/saved_model.pb": b"grapH"}  # same size and ETag, other bytes
    assert "CRC32C" in problems(objects, flipped)[0]

    # Leftovers: an object no manifest lists and an open multipart upload; not leases nor state files.
    torn = {
        **objects,
        "p/run/ck/variables/variables.index": (1, "x", 0.0),
        "p/.checkpointd-leases/run.json": (1, "l", 0.0),
    }
    torn["p/run/train/checkpoint"] = (1, "s", 0.0)
    bucket = s3_bucket.Bucket(torn, [("p/run/ck/variables/v", "u1")], {key: manifest})
    assert s3_bucket.leftovers(bucket, set()) == [
        "p/run/ck/variables/variables.index",
        "multipart upload of p/run/ck/variables/v",
    ]

    # Phases, from a staged save's files against the bucket.
    ck = f"p/run/ck/{s3_bucket.MANIFEST}"
    staged = s3_bucket.Staged("run", "ck", 4, ck, {
        "p/run/ck/variables/variables.index": (1, "x"), "p/run/ck/variables/v": (9, "y-2"),
    })  # fmt: skip
    older = s3_bucket.Staged("run", "ck", 2, ck, {})  # an earlier save's staging dir
    staging = [(Path(".checkpointd-tmp-ck-0123456789abcdef"), staged)]
    pending = s3_bucket.Pending("ck", 4, ck)
    phase = s3_bucket.phase
    assert phase(None, staging, bucket, None) == "idle"
    assert phase(pending, [], bucket, None) == "rpc"
    assert phase(pending, [(staging[0][0], older)], bucket, None) == "rpc"
    assert phase(pending, [(staging[0][0], None)], bucket, None) == "write"
    assert phase(pending, staging, bucket, None) == "multipart"
    no_upload = s3_bucket.Bucket(torn, [], {key: manifest})
    assert phase(pending, staging, no_upload, None) == "upload"
    up = s3_bucket.Bucket({**torn, "p/run/ck/variables/v": (9, "y-2", 0.0)}, [], {key: manifest})
    assert phase(pending, staging, up, None) == "unmanifested"
    up.manifests[ck] = {"step": 2, "files": []}  # the replaced save's: this one is not committed
    assert phase(pending, staging, up, None) == "unmanifested"
    up.manifests[ck] = {"step": 4, "files": []}
    assert phase(pending, [], up, None) == "committed"  # (its staging dir may be gone already)
    assert phase(pending, staging, up, ["ck-3"]) == "state-file"
