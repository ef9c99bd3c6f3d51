"""WriteFence: every write attempt under a save being written is fenced by its run's lease; nothing else is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from botocore.hooks import HierarchicalEmitter

from checkpointd.protocol.errors import RunHeldError
from checkpointd.storage.s3.fencing import WriteFence

ENDPOINT = "http://127.0.0.1:7480"


class _Lease:
    def __init__(self) -> None:
        self.lost: set[str] = set()
        self.checked: list[str] = []

    def check(self, run: str) -> None:
        self.checked.append(run)
        if run in self.lost:
            raise RunHeldError(f"lost {run}")


@pytest.fixture
def world() -> tuple[HierarchicalEmitter, WriteFence, _Lease]:
    events, lease = HierarchicalEmitter(), _Lease()
    fence = WriteFence(SimpleNamespace(meta=SimpleNamespace(events=events)), "bkt", lease.check)
    fence.writing("/staging/a", "p/run-a/train/ckpt-5", "run-a")  # a checkpoint: files beside others
    fence.writing("/staging/b", "p/run-b/policy-1", "run-b")  # a policy dir
    return events, fence, lease


def _send(events: HierarchicalEmitter, operation: str, key: str) -> None:
    events.emit(f"before-send.s3.{operation}", request=SimpleNamespace(url=f"{ENDPOINT}/bkt/{key}?partNumber=1"))


@pytest.mark.parametrize(
    "operation", ["PutObject", "UploadPart", "UploadPartCopy", "CopyObject", "CreateMultipartUpload"]
)
def test_a_write_under_a_save_of_a_lost_run_is_refused_before_it_is_sent(world, operation: str) -> None:  # noqa: ANN001
    events, _, lease = world
    lease.lost.add("run-a")
    with pytest.raises(RunHeldError):
        _send(events, operation, "p/run-a/train/ckpt-5.data-00000-of-00001")
    with pytest.raises(RunHeldError):
        _send(events, operation, "p/run-a/train/ckpt-5.checkpointd.manifest.json")
    _send(events, operation, "p/run-b/policy-1/variables/variables.index")  # run-b holds its lease
    assert lease.checked[-1] == "run-b"


def test_reads_other_keys_and_finished_saves_are_not_fenced(world) -> None:  # noqa: ANN001
    events, fence, lease = world
    lease.lost.update({"run-a", "run-b"})
    _send(events, "GetObject", "p/run-a/train/ckpt-5.index")  # a read
    _send(events, "PutObject", "p/run-a/train/ckpt-50.index")  # another checkpoint's name
    _send(events, "PutObject", "p/run-b/policy-10/saved_model.pb")  # another dir's
    _send(events, "PutObject", "p/.checkpointd-leases/run-a.json")  # the lease itself
    assert lease.checked == []
    fence.done("/staging/a")
    _send(events, "PutObject", "p/run-a/train/ckpt-5.index")
    assert fence.run_of("p/run-b/policy-1/x") == "run-b" and fence.run_of("p/run-a/train/ckpt-5.index") is None
