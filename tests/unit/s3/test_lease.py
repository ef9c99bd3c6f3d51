"""Run leases: the document, the holder's and the observer's timing, and S3Leases over a fake bucket with a fake clock."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
from typing import Any

import pytest

from checkpointd.core import lease
from checkpointd.core.lease import Holding, LeaseDoc, LeaseDocError, Sighting
from checkpointd.protocol.errors import RunHeldError, UnavailableError
from checkpointd.storage.s3 import LEASES_DIR, S3Leases

# The document.


def _doc(**changes: Any) -> LeaseDoc:
    fields: dict[str, Any] = dict(owner="host-a-12-beef", host="host-a", pid=12, ttl=30.0, renewed_at=1000.0)
    fields.update(changes)
    return LeaseDoc(**fields)


def test_a_lease_document_round_trips_and_every_write_changes_it() -> None:
    doc = _doc(idle=120.0)
    assert LeaseDoc.parse(doc.encode(), "k") == doc
    renewed = doc.next(1010.0)
    assert (renewed.seq, renewed.renewed_at, renewed.released) == (1, 1010.0, False)
    assert renewed.encode() != doc.encode()  # so its ETag (the MD5 of the body) changes too
    assert doc.next(1010.0, released=True).released
    taken = doc.taken_by(_doc(owner="host-b-3-cafe", host="host-b", pid=3))
    assert (taken.owner, taken.seq) == ("host-b-3-cafe", 1)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"{not json", "is not JSON"),
        (b"[1]", "not a JSON object"),
        (json.dumps({"version": 99}).encode(), "version 99"),
        (json.dumps({"version": 1, "owner": "o"}).encode(), "malformed"),
        (json.dumps({**json.loads(_doc().encode()), "pid": True}).encode(), "malformed: pid is True"),
        (json.dumps({**json.loads(_doc().encode()), "ttl": 0}).encode(), "ttl of 0"),
    ],
)
def test_a_bad_lease_document_is_refused_naming_the_object(data: bytes, match: str) -> None:
    with pytest.raises(LeaseDocError, match=match) as caught:
        LeaseDoc.parse(data, "s3://b/.checkpointd-leases/r.json")
    assert "s3://b/.checkpointd-leases/r.json" in str(caught.value)


@pytest.mark.parametrize(
    ("ttl", "idle", "match"),
    [
        (2.0, 120.0, "lease_seconds must be >= 3"),
        (float("nan"), 120.0, "lease_seconds"),
        (30.0, 10.0, "lease_idle_seconds must be >= lease_seconds"),
        (30.0, float("inf"), "lease_idle_seconds"),
    ],
)
def test_nonsense_lease_timing_is_refused(ttl: float, idle: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lease.check_timing(ttl, idle)


def test_owner_ids_name_the_host_and_pid_and_differ_per_process() -> None:
    a, b = lease.new_owner("h", 5), lease.new_owner("h", 5)
    assert a.startswith("h-5-") and a != b


# The timing rules.


def test_a_holder_trusts_its_lease_from_the_send_of_its_last_renewal_for_ttl_minus_the_margin() -> None:
    holding = Holding(ttl=30.0, base=100.0)
    assert holding.renew_at == 110.0
    assert holding.valid(123.9) and not holding.valid(124.0)  # 100 + 30 - 6
    holding.renewed(110.0)
    assert holding.valid_until == 134.0
    holding.renewed(105.0)  # an older send never moves it back
    assert holding.valid_until == 134.0


def test_an_observer_counts_expiry_from_the_first_sight_of_an_unchanged_etag() -> None:
    doc = _doc(ttl=10.0)
    seen = Sighting.of(None, '"e1"', 50.0)
    assert Sighting.of(seen, '"e1"', 55.0) is seen
    assert not seen.expired(doc, 59.9) and seen.expires_in(doc, 55.0) == 5.0
    assert seen.expired(doc, 60.0)
    renewed = Sighting.of(seen, '"e2"', 59.0)  # a renewal restarts the count
    assert renewed.since == 59.0 and not renewed.expired(doc, 60.0)
    assert Sighting(etag="x", since=0.0).expired(_doc(released=True), 0.0)  # a released one at once


@pytest.mark.parametrize("delay", [0.0, 0.3, 5.0])
def test_an_observer_never_takes_a_lease_before_its_holder_stopped_trusting_it(delay: float) -> None:
    # The holder sends its renewal at 100; the server stores it at 100 + delay;
    # the observer first reads the new ETag no sooner than that.
    ttl = 9.0
    holding = Holding(ttl, base=100.0)
    seen = Sighting.of(None, '"w"', 100.0 + delay)
    takeover = seen.since + ttl
    assert not seen.expired(_doc(ttl=ttl), takeover - 1e-6)
    assert holding.valid_until + lease.margin(ttl) <= takeover
    # Clocks running at rates 10% apart still leave part of the margin.
    assert holding.base + (ttl - lease.margin(ttl)) * 1.1 < takeover


def test_the_held_message_names_the_holder_and_what_to_do() -> None:
    doc = _doc(idle=120.0)
    message = lease.held_message("r", doc, Sighting('"e"', 10.0), 13.0, 1003.0)
    assert message == (
        "run 'r' is written by daemon host-a (pid 12, lease renewed 3 s ago, expires in 27 s if that daemon "
        "is gone; that daemon lets go of a run unused for 120 s); close the run there, or retry after the "
        "lease expires"
    )


def test_a_holder_renewed_longer_ago_than_the_lease_lasts_is_said_to_look_gone() -> None:
    doc = _doc()
    assert lease.describe_holder(doc, doc.renewed_at + 3) == "host-a (pid 12, lease renewed 3 s ago)"
    stale = lease.describe_holder(doc, doc.renewed_at + 900)
    assert stale.startswith("host-a (pid 12, lease renewed 900 s ago; it lasts 30 s, so its holder looks gone")
    released = _doc(released=True)
    assert "looks gone" not in lease.describe_holder(released, doc.renewed_at + 900)


# S3Leases over a fake bucket.


class _Refused(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}}


class FakeBucket:
    """put_object/get_object with S3's conditional writes; ETags change with every body."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, str]] = {}
        self.writes = 0
        self.listings = 0
        self.fail: Exception | None = None

    def put_object(
        self, Bucket: str, Key: str, Body: bytes, IfMatch: str | None = None, IfNoneMatch: str | None = None
    ) -> dict[str, str]:  # noqa: N803, E501
        if self.fail is not None:
            raise self.fail
        current = self.objects.get(Key)
        if IfNoneMatch == "*" and current is not None:
            raise _Refused("PreconditionFailed")
        assert IfMatch is None or not IfMatch.startswith('"'), "radosgw 16 refuses a quoted If-Match"
        if IfMatch is not None and (current is None or current[1] != IfMatch):
            raise _Refused("PreconditionFailed" if current is not None else "NoSuchKey")
        self.writes += 1
        etag = f"{self.writes:08x}"
        self.objects[Key] = (bytes(Body), etag)
        return {"ETag": f'"{etag}"'}  # quoted, as S3 answers; IfMatch compares bare ones (as radosgw does)

    def get_object(self, Bucket: str, Key: str) -> dict[str, Any]:  # noqa: N803
        if self.fail is not None:
            raise self.fail
        if Key not in self.objects:
            raise _Refused("NoSuchKey")
        body, etag = self.objects[Key]
        return {"Body": io.BytesIO(body), "ETag": f'"{etag}"'}

    def get_paginator(self, operation: str) -> Any:
        assert operation == "list_objects_v2"
        bucket = self

        class Pages:
            def paginate(self, Bucket: str, Prefix: str) -> list[dict[str, Any]]:  # noqa: N803
                bucket.listings += 1
                return [{"Contents": [{"Key": k} for k in sorted(bucket.objects) if k.startswith(Prefix)]}]

        return Pages()

    def doc(self, key: str) -> LeaseDoc:
        return LeaseDoc.parse(self.objects[key][0], key)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Lost:
    def __init__(self) -> None:
        self.held: list[int] = []
        self.lost: list[str] = []

    def leases_held(self, count: int) -> None:
        self.held.append(count)

    def lease_lost(self, run: str) -> None:
        self.lost.append(run)


@pytest.fixture
def bucket() -> FakeBucket:
    return FakeBucket()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _leases(bucket: FakeBucket, clock: FakeClock, owner: str, **kwargs: Any) -> S3Leases:
    return S3Leases(
        bucket, "bkt", "pre", ttl=9.0, idle=30.0, owner=owner, clock=clock, wall=clock, background=False, **kwargs
    )


KEY = f"pre/{LEASES_DIR}/r.json"


def test_the_first_daemon_creates_the_lease_and_a_second_is_refused_naming_it(
    bucket: FakeBucket, clock: FakeClock
) -> None:
    a, b = _leases(bucket, clock, "a-1-x"), _leases(bucket, clock, "b-2-y")
    a.hold("r", None)
    assert bucket.doc(KEY).owner == "a-1-x"
    writes = bucket.writes
    a.hold("r", None)
    a.check("r")
    assert bucket.writes == writes  # holding what it holds costs no request
    with pytest.raises(RunHeldError, match=r"run 'r' is written by daemon .* expires in 9 s if that daemon is gone"):
        b.hold("r", None)
    with pytest.raises(RunHeldError, match="does not hold the lease"):
        b.check("r")
    assert a.holder("r") == "" and b.holder("r") is not None and "lease renewed 0 s ago" in str(b.holder("r"))


def test_a_released_lease_is_taken_at_once(bucket: FakeBucket, clock: FakeClock) -> None:
    a, b = _leases(bucket, clock, "a-1-x"), _leases(bucket, clock, "b-2-y")
    a.hold("r", None)
    a.release("r")
    assert bucket.doc(KEY).released and b.holder("r") is None
    b.hold("r", None)
    assert bucket.doc(KEY).owner == "b-2-y"
    with pytest.raises(RunHeldError):
        a.check("r")


def test_a_dead_holders_lease_is_taken_after_a_full_ttl_unchanged_then_the_old_holder_has_lost_it(
    bucket: FakeBucket, clock: FakeClock
) -> None:
    sink = Lost()
    a, b = _leases(bucket, clock, "a-1-x", sink=sink), _leases(bucket, clock, "b-2-y")
    a.hold("r", None)
    clock.now += 1
    with pytest.raises(RunHeldError):
        b.hold("r", None)  # first sight of a's ETag at 1001
    clock.now += 6.5  # a is paused: no renewal; its own validity ended at 1000 + 9 - 1.8
    with pytest.raises(RunHeldError, match="lapsed"):
        a.check("r")
    clock.now += 2.4
    with pytest.raises(RunHeldError, match="expires in 0 s"):
        b.hold("r", None)  # 8.9 s unchanged
    clock.now += 0.1
    b.hold("r", None)
    assert bucket.doc(KEY).owner == "b-2-y"
    a.tick()  # a wakes up: its renewal gets 412 and finds another owner
    assert sink.lost == ["r"]
    with pytest.raises(RunHeldError, match="lost the lease on run 'r': taken over by"):
        a.check("r")
    with pytest.raises(RunHeldError, match="written by daemon"):
        a.hold("r", None)


def test_renewals_keep_the_lease_and_keep_observers_waiting(bucket: FakeBucket, clock: FakeClock) -> None:
    a, b = _leases(bucket, clock, "a-1-x"), _leases(bucket, clock, "b-2-y")
    a.hold("r", None)
    for _ in range(10):  # 30 s, far past the ttl, renewed every 3 s
        clock.now += 3
        a.tick()
        a.check("r")
        with pytest.raises(RunHeldError):
            b.hold("r", None)
    assert bucket.doc(KEY).seq >= 10


def test_failed_renewals_let_the_lease_lapse_and_it_is_taken_back_once_the_bucket_answers(
    bucket: FakeBucket, clock: FakeClock
) -> None:
    a = _leases(bucket, clock, "a-1-x")
    a.hold("r", None)
    bucket.fail = _Refused("ServiceUnavailable")
    for _ in range(3):
        clock.now += 3
        a.tick()
    with pytest.raises(RunHeldError, match="lapsed: not renewed for 9.0 s .*ServiceUnavailable"):
        a.check("r")
    with pytest.raises(UnavailableError, match="could not read its lease"):
        a.hold("r", None)
    bucket.fail = None
    a.hold("r", None)  # still its own: renewed
    a.check("r")


def test_a_renewal_whose_answer_was_lost_is_adopted_not_counted_as_lost(bucket: FakeBucket, clock: FakeClock) -> None:
    sink = Lost()
    a = _leases(bucket, clock, "a-1-x", sink=sink)
    a.hold("r", None)
    body, _ = bucket.objects[KEY]
    bucket.objects[KEY] = (LeaseDoc.parse(body, KEY).next(clock.now).encode(), "other-etag")  # our write, unseen
    clock.now += 3
    a.tick()
    assert sink.lost == []
    a.check("r")
    clock.now += 3
    a.tick()  # renews with the adopted ETag
    assert bucket.objects[KEY][1] != "other-etag"


def test_an_idle_run_is_released_unless_a_save_is_in_flight(bucket: FakeBucket, clock: FakeClock) -> None:
    busy = {"r": True}
    a = _leases(bucket, clock, "a-1-x", busy=lambda run: busy.get(run, False))
    a.hold("r", None)
    a.hold("s", None)
    clock.now += 31
    a.tick()
    assert not bucket.doc(KEY).released and bucket.doc(f"pre/{LEASES_DIR}/s.json").released
    busy["r"] = False
    a.tick()
    assert bucket.doc(KEY).released
    a.hold("r", None)  # the next save takes it again, lazily
    assert not bucket.doc(KEY).released


def test_close_releases_every_lease(bucket: FakeBucket, clock: FakeClock) -> None:
    sink = Lost()
    a = _leases(bucket, clock, "a-1-x", sink=sink)
    a.hold("r", None)
    a.hold("s", None)
    a.close()
    assert bucket.doc(KEY).released and bucket.doc(f"pre/{LEASES_DIR}/s.json").released
    assert sink.held[-1] == 0


def test_an_unreadable_lease_object_counts_as_held_until_it_expires(bucket: FakeBucket, clock: FakeClock) -> None:
    bucket.objects[KEY] = (b"garbage", "g")
    a = _leases(bucket, clock, "a-1-x")
    with pytest.raises(RunHeldError, match="an unknown daemon"):
        a.hold("r", None)
    clock.now += 9
    a.hold("r", None)
    assert bucket.doc(KEY).owner == "a-1-x"


def test_a_waiting_hold_gives_up_at_its_deadline(bucket: FakeBucket, clock: FakeClock) -> None:
    a, b = _leases(bucket, clock, "a-1-x"), _leases(bucket, clock, "b-2-y")
    a.hold("r", None)
    with pytest.raises(RunHeldError, match="written by daemon"):
        b.hold("r", clock.now)  # the deadline has come: one look, no wait


def test_the_lease_key_is_under_the_reserved_prefix() -> None:
    leases = S3Leases(FakeBucket(), "bkt", "", owner="o", background=False)
    assert leases.key("run.1") == f"{LEASES_DIR}/run.1.json" and LEASES_DIR.startswith(".checkpointd")


def test_holders_lists_the_leases_once_and_reads_only_those_there(bucket: FakeBucket, clock: FakeClock) -> None:
    a, b = _leases(bucket, clock, "a-1-x"), _leases(bucket, clock, "b-2-y")
    a.hold("r", None)
    a.hold("s", None)
    a.release("s")
    found = b.holders(["r", "s", "never"])
    assert bucket.listings == 1
    assert found["s"] is None and found["never"] is None
    assert str(found["r"]).startswith(f"{b._host} (pid ")  # noqa: SLF001 - both fakes run on this host
    assert a.holders(["r"]) == {"r": ""}


def test_taken_is_called_once_per_acquisition_not_per_hold_or_renewal(bucket: FakeBucket, clock: FakeClock) -> None:
    taken: list[tuple[str, str]] = []
    a = _leases(bucket, clock, "a-1-x", taken=lambda run: taken.append(("a", run)))
    b = _leases(bucket, clock, "b-2-y", taken=lambda run: taken.append(("b", run)))
    a.hold("r", None)
    a.hold("r", None)
    clock.now += 3
    a.tick()  # renewed, not taken again
    with pytest.raises(RunHeldError):
        b.hold("r", None)
    assert taken == [("a", "r")]
    a.release("r")
    b.hold("r", None)  # a takeover: b's saves of r may follow a's unfinished retention
    assert taken == [("a", "r"), ("b", "r")]


def test_a_hold_that_waits_says_once_for_whom_before_it_waits_and_logs_it(
    bucket: FakeBucket, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = _leases(bucket, clock, "a-1-x"), _leases(bucket, clock, "b-2-y")
    a.hold("r", None)
    clock.now += 4  # a's last renewal, 4 s ago by the wall clock too
    told: list[str] = []

    def waiting(text: str) -> None:
        told.append(text)
        a.release("r")  # the holder lets go while b waits: b's next look takes it

    with caplog.at_level(logging.INFO, logger="checkpointd.storage.s3.lease"):
        b.hold("r", clock.now + 20, waiting)
    assert told == [
        f"waiting up to 20 s for the lease of run r held by host {socket.gethostname()}, pid {os.getpid()}, renewed 4 s ago"
    ]
    assert f"lease: {told[0]}" in caplog.messages
    assert bucket.doc(KEY).owner == "b-2-y"
    b.hold("r", clock.now + 20, waiting)  # held now: no wait, nothing said
    assert len(told) == 1


def test_the_tenure_lasts_while_the_lease_is_held_without_a_break_even_renewed_late(
    bucket: FakeBucket, clock: FakeClock
) -> None:
    a, b = _leases(bucket, clock, "a-1-x"), _leases(bucket, clock, "b-2-y")
    assert a.tenure("r") is None
    a.hold("r", None)
    first = a.tenure("r")
    assert first is not None
    clock.now += 3
    a.tick()
    assert a.tenure("r") == first  # renewed
    bucket.fail = _Refused("ServiceUnavailable")
    for _ in range(3):
        clock.now += 3
        a.tick()
    assert a.tenure("r") is None  # lapsed: not to be trusted now
    bucket.fail = None
    a.hold("r", None)  # renewed against its own ETag: nobody took it meanwhile
    assert a.tenure("r") == first
    a.release("r")
    assert a.tenure("r") is None
    b.hold("r", None)
    b.release("r")
    a.hold("r", None)  # taken again, after another daemon held it
    assert a.tenure("r") not in (None, first)


def test_a_lease_lost_to_another_daemon_ends_the_tenure(bucket: FakeBucket, clock: FakeClock) -> None:
    a, b = _leases(bucket, clock, "a-1-x"), _leases(bucket, clock, "b-2-y")
    a.hold("r", None)
    first = a.tenure("r")
    with pytest.raises(RunHeldError):
        b.hold("r", None)  # b's first sight of a's lease
    clock.now += 10  # a paused past the ttl: b sees the same ETag for a full ttl and takes it
    b.hold("r", None)
    a.tick()  # a's renewal meets b's write
    assert a.tenure("r") is None
    with pytest.raises(RunHeldError):
        a.hold("r", None)
    assert b.tenure("r") is not None and first is not None
