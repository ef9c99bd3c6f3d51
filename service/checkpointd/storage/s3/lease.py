"""Run leases in the bucket: which daemon of a fleet writes a run (implements `ports.Leases`).

One object per run, `<prefix>/.checkpointd-leases/<run>.json`, holding a
`checkpointd.core.lease.LeaseDoc`. It lives under the reserved prefix, which
no run or folder name can take, so listing run folders and recovery never
see it. Every write is conditional (`checkpointd.core.lease` has the timing
rules and why they keep two daemons from holding a run at once):

- acquire: create with `IfNoneMatch='*'`; over a released lease, or one
  whose ETag this daemon has seen unchanged for its full ttl, write with
  `IfMatch=<that ETag>`. A 412 means another daemon won: read it again.
- renew: every ttl/3, by ONE background thread for every held lease (a
  timed wait on a condition, woken when a lease is added or the daemon
  closes), `IfMatch` on the last ETag. A 412 whose new content is another
  owner's marks the run LOST: `check` and `hold` then raise RunHeldError
  naming the new holder (a 412 with our own content is a write of ours
  whose answer got lost: its ETag is adopted).
- release: overwrite as released with `IfMatch` (radosgw 16 has no
  conditional delete); the next daemon takes it at once. A run closed here,
  one unused (no hold or check, no save in flight) for `idle` seconds, and
  every run at `close()` are released, so a trainer that died on this host
  does not pin its run here; its next save here takes the lease again, lazily,
  if it is still free.

`check` is the fence the store calls right before it commits a manifest: it
costs no request (the holder's validity is counted on its own clock).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from checkpointd.core import lease
from checkpointd.core.lease import Holding, LeaseDoc, LeaseDocError, Sighting
from checkpointd.core.ports import LeaseSink, NullLeaseSink
from checkpointd.protocol.errors import RunHeldError, UnavailableError
from checkpointd.protocol.names import RESERVED_PREFIX, check_run_name
from checkpointd.storage.s3.client import error_code, small_requests

_LOGGER = logging.getLogger(__name__)

LEASES_DIR = RESERVED_PREFIX + "-leases"
_POLL_SECONDS = 0.5  # how often a waiting hold() reads the lease again (to see a release soon)
_RENEWERS = 8  # leases renewed at once (a request each; the client has connections for more)


@dataclass
class _Held:
    doc: LeaseDoc
    etag: str
    holding: Holding
    used: float  # monotonic time of the last hold() or check()
    tenure: int  # new each time the lease is taken (`tenure`)
    error: str = ""  # the last renewal's failure, if it failed


def _etag(response: Mapping[str, Any]) -> str:
    """A response's ETag without its quotes."""
    return str(response["ETag"]).strip('"')


def _precondition_failed(e: BaseException) -> bool:
    return error_code(e) in ("PreconditionFailed", "412")


def _missing(e: BaseException) -> bool:
    return error_code(e) in ("NoSuchKey", "404")


class S3Leases:
    """The leases of one daemon on the runs of one bucket prefix. Thread-safe."""

    def __init__(
        self,
        client: Any,
        bucket: str,
        prefix: str,
        *,
        ttl: float = 30.0,
        idle: float = 120.0,
        busy: Callable[[str], bool] | None = None,
        sink: LeaseSink | None = None,
        owner: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        background: bool = True,
        taken: Callable[[str], None] | None = None,
    ) -> None:
        """Args:
        client: a boto3 S3 client (the store's).
        bucket, prefix: the store's bucket and key prefix ("" or "a/b").
        ttl: --lease-seconds.
        idle: --lease-idle-seconds: a run unused this long is released.
        busy: True while a run has a save in flight or queued (not idle).
        sink: counts held and lost leases.
        owner: this daemon's owner id; a fresh one by default.
        clock, wall: monotonic and Unix time (tests pass fakes).
        background: run the renewal thread; tests call `tick()` instead.
        taken: called with the run each time `hold` takes its lease (not when
            it renews one this daemon holds), before `hold` returns and
            outside the run's lock: the run's saves in the bucket may be
            another daemon's, left as it left them (the server applies the
            run's retention there).
        """
        lease.check_timing(ttl, idle)
        self.client = client
        self._small = small_requests(client)  # a lease's GET and PUT are small requests (signed)
        self.bucket = bucket
        self._base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self.ttl = ttl
        self.idle = idle
        self.owner = owner or lease.new_owner()
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._busy = busy or (lambda run: False)
        self._taken = taken or (lambda run: None)
        self._sink = sink or NullLeaseSink()
        self._clock = clock
        self._wall = wall
        self._cond = threading.Condition()
        self._held: dict[str, _Held] = {}
        self._lost: dict[str, str] = {}  # run -> who took it, for messages
        self._seen: dict[str, Sighting] = {}  # other daemons' leases, as observed
        self._run_locks: dict[str, threading.Lock] = {}
        self._tenures = 0  # leases taken so far (each hold's `tenure`)
        self._closed = False
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # renewals side by side, made when needed
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._renew_loop, name="leases", daemon=True)
            self._thread.start()

    def key(self, run: str) -> str:
        return f"{self._base}{LEASES_DIR}/{check_run_name(run)}.json"

    def describe(self) -> str:
        return f"leases of {self.ttl:g} s as {self.owner}"

    # The Leases protocol.

    def hold(self, run: str, deadline: float | None, waiting: Callable[[str], None] | None = None) -> None:
        started = self._clock()
        told = False
        # Held and valid (every save of a run held here): no wait for the run's
        # lock, which a renewal of it holds for its request's round trip.
        if self._touch_if_valid(run):
            return
        with self._run_lock(run):
            self._touch(run)
            if self._valid(run):
                return
            if self._held_but_lapsed(run) and self._renew(run):
                return
        while True:
            with self._run_lock(run):
                other = self._try_acquire(run)
            if other is None:
                self._taken(run)
                return
            doc, sighting = other
            now = self._clock()
            if deadline is None or now >= deadline:
                raise RunHeldError(lease.held_message(run, doc, sighting, now, self._wall(), now - started))
            if not told:  # once per call: who it waits for, before the first pause
                told = True
                text = lease.wait_message(run, doc, self._wall(), deadline - now)
                _LOGGER.info("lease: %s", text)
                if waiting is not None:
                    waiting(text)
            pause = min(deadline - now, _POLL_SECONDS, max(sighting.expires_in(doc, now), 0.01))
            with self._cond:
                if self._closed:
                    raise UnavailableError(
                        "the daemon is shutting down; register the run again on a daemon that serves"
                    )
                self._cond.wait(pause)

    def check(self, run: str) -> None:
        with self._cond:
            held = self._held.get(run)
            now = self._clock()
            if held is not None:
                held.used = now
                if held.holding.valid(now):
                    return
                reason = (
                    f"this daemon's lease on run {run!r} lapsed: not renewed for "
                    f"{now - held.holding.base:.1f} s ({held.error or 'no renewal succeeded in time'})"
                )
            elif run in self._lost:
                reason = f"this daemon lost the lease on run {run!r}: {self._lost[run]}"
            else:
                reason = f"this daemon does not hold the lease on run {run!r} (it was released)"
        raise RunHeldError(f"{reason}; the save is not committed; a next save here takes the lease again if it is free")

    def tenure(self, run: str) -> int | None:
        """An id of this daemon's hold on the run's lease, the same for as long as it holds it without a break;
        None unless held and valid now.

        Two equal answers mean nobody else held the run between them, so
        nobody else wrote its saves: a renewal, even one late after the
        lease lapsed here, succeeds only against the ETag of our last write
        (any other daemon's take changes it). Taken again after a loss, a
        release or an idle release: a new id.
        """
        with self._cond:
            held = self._held.get(run)
            if held is None or not held.holding.valid(self._clock()):
                return None
            return held.tenure

    def release(self, run: str) -> None:
        with self._run_lock(run):
            self._release(run, "closed")

    def holder(self, run: str) -> str | None:
        if self._valid(run):
            return ""
        try:
            got = self._read(run)
        except Exception as e:  # noqa: BLE001 - status must not fail for one run's lease
            return f"unknown (the lease could not be read: {e})"
        if got is None:
            return None
        doc, etag = got
        if doc.owner == self.owner:
            return "" if not doc.released else None
        with self._cond:
            sighting = self._seen[run] = Sighting.of(self._seen.get(run), etag, self._clock())
        if sighting.expired(doc, self._clock()):
            return None
        return lease.describe_holder(doc, self._wall())

    def holders(self, runs: Iterable[str]) -> Mapping[str, str | None]:
        """Each run's holder (as `holder`), reading only the runs that have a lease object (one listing)."""
        wanted = list(runs)
        present = set()
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=f"{self._base}{LEASES_DIR}/"):
            for obj in page.get("Contents", []):
                present.add(obj["Key"].rpartition("/")[2].removesuffix(".json"))
        return {run: (self.holder(run) if run in present else None) for run in wanted}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._cond:
            runs = list(self._held)
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        for run in runs:
            with self._run_lock(run):
                self._release(run, "the daemon is stopping")

    # Renewal and idle release.

    def tick(self) -> float:
        """Renews what is due and releases idle runs; returns the monotonic time of the next due renewal."""
        now = self._clock()
        with self._cond:
            due = [run for run, h in self._held.items() if h.holding.renew_at <= now or h.error]
            idle = [run for run, h in self._held.items() if now - h.used >= self.idle]
        for run in idle:
            if self._busy(run):
                continue
            with self._run_lock(run):
                held = self._held.get(run)
                if held is not None and self._clock() - held.used >= self.idle:
                    self._release(run, f"unused for {self.idle:g} s")
        if len(due) > 1:  # leases taken together fall due together: renewed side by side, soonest first
            with self._cond:
                due.sort(key=lambda run: self._held[run].holding.renew_at if run in self._held else now)
            list(self._renewers().map(self._renew_held, due))  # raises the first failure, as one at a time did
        elif due:
            self._renew_held(due[0])
        with self._cond:
            soonest = [min(h.holding.renew_at, h.used + self.idle) for h in self._held.values()]
            retries = [self._clock() + lease.renew_interval(self.ttl) / 3 for h in self._held.values() if h.error]
        return min(soonest + retries, default=self._clock() + lease.renew_interval(self.ttl))

    def _renew_held(self, run: str) -> None:
        with self._run_lock(run):
            if run in self._held:
                self._renew(run)

    def _renewers(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads that renew due leases side by side: one after another, a round of a fleet's
        leases (a request each) outlasted what remains of the first ones' ttl under load."""
        with self._cond:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(_RENEWERS, thread_name_prefix="lease-renew")
            return self._pool

    def _renew_loop(self) -> None:
        while True:
            try:
                next_at = self.tick()
            except Exception:  # noqa: BLE001 - the renewal thread must outlive any one failure
                _LOGGER.exception("lease renewal failed")
                next_at = self._clock() + lease.renew_interval(self.ttl) / 3
            with self._cond:
                if self._closed:
                    return
                wait = next_at - self._clock()
                if wait > 0:
                    self._cond.wait(wait)  # woken early by a new lease or close()
                if self._closed:
                    return

    # One run's lease; each called with the run's lock held.

    def _renew(self, run: str) -> bool:
        """Renews a held lease; True if it is still ours (renewed or adopted)."""
        held = self._held.get(run)
        if held is None:
            return False
        doc = held.doc.next(self._wall())
        sent = self._clock()
        try:
            etag = self._put(run, doc, if_match=held.etag)
        except Exception as e:  # noqa: BLE001 - classified below
            if not _precondition_failed(e) and not _missing(e):
                with self._cond:
                    held.error = f"{type(e).__name__}: {e}"
                _LOGGER.warning("lease: could not renew run=%s: %s", run, e)
                return held.holding.valid(self._clock())
            return self._after_conflict(run, held)
        with self._cond:
            held.doc, held.etag, held.error = doc, etag, ""
            held.holding.renewed(sent)
        return True

    def _after_conflict(self, run: str, held: _Held) -> bool:
        """A conditional write got 412 (or the object is gone): ours after all, or lost."""
        try:
            got = self._read(run)
        except Exception as e:  # noqa: BLE001 - cannot tell: try again at the next tick
            with self._cond:
                held.error = f"{type(e).__name__}: {e}"
            return held.holding.valid(self._clock())
        if got is not None and got[0].owner == self.owner and not got[0].released:
            with self._cond:  # a write of ours whose answer was lost; its time is unknown: keep the old base
                held.doc, held.etag, held.error = got[0], got[1], ""
            return True
        if got is None:
            taker = "its lease object was deleted"
        else:
            taker = (
                f"taken over by {lease.describe_holder(got[0], self._wall())}"
                if not got[0].released
                else "released by another daemon"
            )
        with self._cond:
            del self._held[run]
            self._lost[run] = taker
        self._sink.leases_held(len(self._held))
        self._sink.lease_lost(run)
        _LOGGER.warning("lease: lost run=%s: %s; its saves here fail until it is taken back", run, taker)
        return False

    def _try_acquire(self, run: str) -> tuple[LeaseDoc, Sighting] | None:
        """Takes the lease if it is free; else (another daemon's document, our sighting of it)."""
        for _ in range(8):  # each lost race is another daemon's write: read it again
            sent = self._clock()
            got = self._read(run)
            mine = LeaseDoc(self.owner, self._host, self._pid, self.ttl, self._wall(), seq=0, idle=self.idle)
            try:
                if got is None:
                    etag = self._put(run, mine, if_none_match=True)
                    how = "new"
                else:
                    doc, current = got
                    if doc.owner != self.owner and not doc.released:
                        with self._cond:
                            sighting = self._seen[run] = Sighting.of(self._seen.get(run), current, self._clock())
                        if not sighting.expired(doc, self._clock()):
                            return doc, sighting
                        how = f"expired, from {lease.describe_holder(doc, self._wall())}"
                    else:
                        how = "released" if doc.released else "ours"
                    mine = doc.taken_by(mine)
                    sent = self._clock()
                    etag = self._put(run, mine, if_match=current)
            except Exception as e:  # noqa: BLE001 - classified here
                if _precondition_failed(e):
                    continue
                raise UnavailableError(f"run {run!r}: could not write its lease in the bucket: {e}") from e
            with self._cond:
                self._tenures += 1
                self._held[run] = _Held(mine, etag, Holding(self.ttl, sent), self._clock(), self._tenures)
                self._lost.pop(run, None)
                self._seen.pop(run, None)
                self._cond.notify_all()  # the renewal thread schedules it
            self._sink.leases_held(len(self._held))
            _LOGGER.info("lease: holding run=%s (%s)", run, how)
            return None
        raise UnavailableError(f"run {run!r}: its lease kept changing under this daemon; retry")

    def _release(self, run: str, why: str) -> None:
        with self._cond:
            held = self._held.pop(run, None)
            self._lost.pop(run, None)
        if held is None:
            return
        self._sink.leases_held(len(self._held))
        try:
            self._put(run, held.doc.next(self._wall(), released=True), if_match=held.etag)
            _LOGGER.info("lease: released run=%s (%s)", run, why)
        except Exception as e:  # noqa: BLE001 - it expires anyway
            _LOGGER.warning("lease: could not release run=%s (%s): %s; it expires in %g s", run, why, e, self.ttl)

    # State, under the condition's lock.

    def _valid(self, run: str) -> bool:
        with self._cond:
            held = self._held.get(run)
            return held is not None and held.holding.valid(self._clock())

    def _held_but_lapsed(self, run: str) -> bool:
        with self._cond:
            return run in self._held

    def _touch_if_valid(self, run: str) -> bool:
        """Marks a held, valid lease used; False (nothing marked) if it is not, or is due for its idle release.

        The idle release decides under the run's lock, on `used`; a run it
        may be releasing (unused for `idle`) is left to `hold`'s locked path,
        which waits for that release to end and takes the lease again.
        """
        with self._cond:
            held = self._held.get(run)
            now = self._clock()
            if held is None or not held.holding.valid(now) or now - held.used >= self.idle:
                return False
            held.used = now
            return True

    def _touch(self, run: str) -> None:
        with self._cond:
            held = self._held.get(run)
            if held is not None:
                held.used = self._clock()

    def _run_lock(self, run: str) -> threading.Lock:
        with self._cond:
            return self._run_locks.setdefault(run, threading.Lock())

    # The bucket.

    def _read(self, run: str) -> tuple[LeaseDoc, str] | None:
        """The run's lease document and ETag; None if there is none.

        A lease object this daemon cannot read counts as another daemon's
        (it expires by the observer's rule with this daemon's ttl).
        """
        key = self.key(run)
        try:
            response = self._small.get_object(Bucket=self.bucket, Key=key)
        except Exception as e:
            if _missing(e):
                return None
            raise UnavailableError(f"run {run!r}: could not read its lease s3://{self.bucket}/{key}: {e}") from e
        data, etag = response["Body"].read(), _etag(response)
        try:
            return LeaseDoc.parse(data, f"s3://{self.bucket}/{key}"), etag
        except LeaseDocError as e:
            _LOGGER.warning("%s; treating it as held by an unknown daemon until it expires", e)
            return LeaseDoc("?", "an unknown daemon", 0, self.ttl, 0.0), etag

    def _put(self, run: str, doc: LeaseDoc, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key(run), "Body": doc.encode()}
        if if_match is not None:
            kwargs["IfMatch"] = if_match  # unquoted: radosgw 16 compares it with the bare hex (AWS takes both)
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        return _etag(self._small.put_object(**kwargs))
