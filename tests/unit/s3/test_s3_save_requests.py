"""SaveRequests: each attempt of a save's writes is fenced by its run's lease, and none is sent or retried past its deadline."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from botocore.hooks import HierarchicalEmitter

from checkpointd.protocol.errors import RunHeldError
from checkpointd.storage.s3.save_requests import SaveDeadlineError, SaveRequests

ENDPOINT = "http://127.0.0.1:7480"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __float__(self) -> float:
        return self.now


_NOW = _Clock()


class _Lease:
    def __init__(self) -> None:
        self.lost: set[str] = set()
        self.checked: list[str] = []

    def check(self, run: str) -> None:
        self.checked.append(run)
        if run in self.lost:
            raise RunHeldError(f"lost {run}")


@pytest.fixture
def world() -> tuple[HierarchicalEmitter, SaveRequests, _Lease]:
    events, lease = HierarchicalEmitter(), _Lease()
    fence = SaveRequests(SimpleNamespace(meta=SimpleNamespace(events=events)), "bkt", lease.check, clock=_NOW.__float__)
    fence.writing("/staging/a", "p/run-a/train/ckpt-5", "run-a", None)  # a checkpoint: files beside others
    fence.writing("/staging/b", "p/run-b/policy-1", "run-b", 100.0)  # a policy dir
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


def test_past_its_deadline_a_save_sends_no_request_and_retries_none_naming_the_last_error(world) -> None:  # noqa: ANN001
    events, _, _ = world
    _NOW.now = 99.0
    key = "p/run-b/policy-1/variables/variables.data-00000-of-00001"
    url = f"{ENDPOINT}/bkt/{key}"
    # A failed attempt before the deadline: botocore may retry it (the hook says nothing).
    events.emit("needs-retry.s3.PutObject", response=({"status_code": 503}, {"ResponseMetadata": {"HTTPStatusCode": 503},
                "Error": {"Code": "SlowDown"}}), caught_exception=None, request_dict={"url": url})  # fmt: skip
    _send(events, "PutObject", key)
    _NOW.now = 100.0
    with pytest.raises(SaveDeadlineError, match="last error: PutObject: HTTP 503 SlowDown"):
        _send(events, "PutObject", key)  # the next attempt is not sent
    with pytest.raises(SaveDeadlineError, match="retried; last error: PutObject: boom"):
        events.emit("needs-retry.s3.PutObject", response=None, caught_exception=OSError("boom"),
                    request_dict={"url": url})  # fmt: skip
    _send(events, "PutObject", "p/run-a/train/ckpt-5.index")  # another save, without a deadline
    _NOW.now = 0.0


def test_a_bounded_block_bounds_this_threads_requests_whatever_their_key(world) -> None:  # noqa: ANN001
    events, requests, _ = world
    _NOW.now = 50.0
    with requests.bounded(50.0):
        with pytest.raises(SaveDeadlineError):
            _send(events, "GetObject", "p/run-c/train/ckpt-1.checkpointd.manifest.json")
    _send(events, "GetObject", "p/run-c/train/ckpt-1.checkpointd.manifest.json")  # outside the block
    with requests.bounded(None):
        _send(events, "GetObject", "p/run-c/train/ckpt-1.checkpointd.manifest.json")
    _NOW.now = 0.0
