"""Run leases: the lease document and the timing rules, with no I/O.

Several daemons share one bucket and nothing else; a run is written by the
one daemon that holds its lease, an object in the bucket
(`checkpointd.storage.s3.lease` reads and writes it). The object holds a
`LeaseDoc` (JSON): the holder's owner id (host, pid and a random token, so
a restarted daemon is a new owner), host and pid for messages, the ttl,
the wall-clock time of its last renewal (for people only), whether it was
released, and a sequence number that changes on every write, so every write
changes the object's ETag.

Writes are conditional: a lease is created with `IfNoneMatch='*'` and every
later write (renewal, takeover, release) carries `IfMatch=<the ETag read>`;
a 412 means another write came first. Nothing here compares clocks of two
machines. The rules:

- Holder (`Holding`): a renewal's validity starts when its request was
  SENT (`base`, the holder's monotonic clock), not when it returned, and
  lasts `ttl - margin(ttl)`. It renews every `renew_interval(ttl)` = ttl/3,
  so two renewals in a row may fail before the lease lapses.
- Observer (`Sighting`, client-go leader election's rule): another
  daemon's lease counts as expired only once the observer has seen the
  SAME ETag for a full ttl on its own monotonic clock, or the document says
  released. A changed ETag restarts the count.

Why two daemons never both think they hold a run: the holder's last
successful write W was sent at holder time `base`; the server stored W
after that, and an observer can first see W's ETag only after the server
stored it. So the observer's count of "unchanged for ttl" starts after
`base` in real time and ends after `base + ttl`, while the holder stopped
trusting W at `base + ttl - margin`. Between the two lies `margin` (ttl/5),
which covers the holder's fence-to-request latency (`check` just before the
manifest PUT) and any difference in the RATE of the two monotonic clocks
(parts per million in practice; the rule fails only if they differ by more
than margin/ttl = 20%). No synchronized clocks are assumed: only elapsed
times on each machine's own clock are compared. A holder paused between its
fence and its request for longer than the margin (SIGSTOP, a frozen VM)
is the case no lease can rule out without server-side fencing; the store
re-checks after the manifest PUT and withdraws a manifest written late.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
from dataclasses import asdict, dataclass, replace
from typing import TypeVar

VERSION = 1
MIN_TTL_SECONDS = 3.0
_MARGIN_FRACTION = 0.2


class LeaseDocError(ValueError):
    """A lease object that is not a lease document this daemon can read."""


def margin(ttl: float) -> float:
    """Seconds before its nominal end that a holder stops trusting its lease."""
    return ttl * _MARGIN_FRACTION


def renew_interval(ttl: float) -> float:
    """Seconds between a holder's renewals."""
    return ttl / 3


def check_timing(ttl: float, idle: float) -> None:
    """Refuses a lease ttl or idle release time that cannot work.

    Raises:
        ValueError: naming the values and what they must be.
    """
    if not MIN_TTL_SECONDS <= ttl < math.inf:  # also refuses NaN
        raise ValueError(
            f"lease_seconds must be >= {MIN_TTL_SECONDS:g} and finite, got {ttl} "
            "(a lease is renewed every third of it over the network)"
        )
    if not ttl <= idle < math.inf:
        raise ValueError(
            f"lease_idle_seconds must be >= lease_seconds ({ttl:g}) and finite, got {idle} "
            "(a run unused that long is released; shorter than a lease would release runs between renewals)"
        )


def new_owner(host: str | None = None, pid: int | None = None) -> str:
    """A fresh owner id: `<host>-<pid>-<random hex>` (a restarted daemon is a new owner)."""
    return f"{host or socket.gethostname()}-{pid if pid is not None else os.getpid()}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class LeaseDoc:
    """The content of a run's lease object.

    Attributes:
        owner: the holder's owner id (unique per daemon process).
        host, pid: where the holder runs, for messages.
        ttl: seconds the lease lasts unrenewed, as observers count it.
        renewed_at: Unix time of the last write, by the holder's clock (for people only).
        released: the holder let go; anyone may take it at once.
        seq: incremented on every write, so every write changes the ETag.
        idle: seconds after which the holder releases a run nobody uses; None if it never does.
    """

    owner: str
    host: str
    pid: int
    ttl: float
    renewed_at: float
    released: bool = False
    seq: int = 0
    idle: float | None = None

    def encode(self) -> bytes:
        return (json.dumps({"version": VERSION, **asdict(self)}, sort_keys=True) + "\n").encode("utf-8")

    @classmethod
    def parse(cls, data: bytes, where: str) -> LeaseDoc:
        """Reads a lease document.

        Raises:
            LeaseDocError: naming `where` and what is wrong.
        """
        try:
            raw = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LeaseDocError(f"the lease {where} is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise LeaseDocError(f"the lease {where} is not a JSON object")
        if raw.get("version") != VERSION:
            raise LeaseDocError(f"the lease {where} has version {raw.get('version')!r}; this daemon reads {VERSION}")
        try:
            doc = cls(
                owner=_typed(raw, "owner", str),
                host=_typed(raw, "host", str),
                pid=_typed(raw, "pid", int),
                ttl=_number(raw, "ttl"),
                renewed_at=_number(raw, "renewed_at"),
                released=_typed(raw, "released", bool),
                seq=_typed(raw, "seq", int),
                idle=None if raw.get("idle") is None else _number(raw, "idle"),
            )
        except (KeyError, TypeError) as e:
            raise LeaseDocError(f"the lease {where} is malformed: {e}") from None
        if not doc.owner or not 0 < doc.ttl < math.inf:
            raise LeaseDocError(f"the lease {where} has an empty owner or a ttl of {doc.ttl}")
        return doc

    def next(self, now: float, *, released: bool = False) -> LeaseDoc:
        """This document as its next write: renewed (or released) at wall time `now`."""
        return replace(self, renewed_at=now, released=released, seq=self.seq + 1)

    def taken_by(self, other: LeaseDoc) -> LeaseDoc:
        """`other` (a new holder's document) written over this one: its seq continues from ours."""
        return replace(other, seq=self.seq + 1)


_T = TypeVar("_T")


def _typed(raw: dict[str, object], key: str, kind: type[_T]) -> _T:
    value = raw[key]
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise TypeError(f"{key} is {value!r}")
    return value


def _number(raw: dict[str, object], key: str) -> float:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{key} is {value!r}")
    return float(value)


@dataclass
class Holding:
    """The holder's side of one lease: when the last successful write was sent.

    Attributes:
        ttl: the lease's ttl.
        base: the holder's monotonic time when the request of its last
            successful write (create, takeover or renewal) was sent.
    """

    ttl: float
    base: float

    @property
    def valid_until(self) -> float:
        return self.base + self.ttl - margin(self.ttl)

    @property
    def renew_at(self) -> float:
        return self.base + renew_interval(self.ttl)

    def valid(self, now: float) -> bool:
        return now < self.valid_until

    def renewed(self, sent: float) -> None:
        """A write sent at monotonic `sent` succeeded."""
        self.base = max(self.base, sent)


@dataclass(frozen=True)
class Sighting:
    """What an observer saw of another daemon's lease: its ETag, and since when (the observer's monotonic clock)."""

    etag: str
    since: float

    @staticmethod
    def of(previous: Sighting | None, etag: str, now: float) -> Sighting:
        """The sighting after reading `etag` at `now`: the count goes on if the ETag is unchanged."""
        if previous is not None and previous.etag == etag:
            return previous
        return Sighting(etag, now)

    def unchanged_for(self, now: float) -> float:
        return max(0.0, now - self.since)

    def expired(self, doc: LeaseDoc, now: float) -> bool:
        """Released, or unchanged for the document's full ttl: another daemon may take it."""
        return doc.released or self.unchanged_for(now) >= doc.ttl

    def expires_in(self, doc: LeaseDoc, now: float) -> float:
        """Seconds until it counts as expired if its holder is gone (0 if it already does)."""
        return 0.0 if doc.released else max(0.0, doc.ttl - self.unchanged_for(now))


def describe_holder(doc: LeaseDoc, wall_now: float) -> str:
    """The holder as a person reads it: `host-b (pid 12, lease renewed 3 s ago)`.

    A lease renewed longer ago than it lasts (by the holder's clock) is said to
    look expired: observers count expiry on their own clock, from when they
    first saw the lease unchanged, so it is still honoured until then.
    """
    ago = max(0.0, wall_now - doc.renewed_at)
    stale = (
        f"; it lasts {doc.ttl:.0f} s, so its holder looks gone: a registration of the run here takes it "
        f"once the lease has stayed unchanged for {doc.ttl:.0f} s"
        if ago > doc.ttl and not doc.released
        else ""
    )
    return f"{doc.host} (pid {doc.pid}, lease renewed {ago:.0f} s ago{stale})"


def held_message(run: str, doc: LeaseDoc, sighting: Sighting, now: float, wall_now: float, waited: float = 0.0) -> str:
    """Why this daemon may not write `run`: who holds it, and what to do."""
    ago = max(0.0, wall_now - doc.renewed_at)
    idle = f"; that daemon lets go of a run unused for {doc.idle:g} s" if doc.idle is not None else ""
    waited_text = f"; waited {waited:.1f} s for it" if waited > 0 else ""
    return (
        f"run {run!r} is written by daemon {doc.host} (pid {doc.pid}, lease renewed {ago:.0f} s ago, "
        f"expires in {sighting.expires_in(doc, now):.0f} s if that daemon is gone{idle}){waited_text}; "
        "close the run there, or retry after the lease expires"
    )


def wait_message(run: str, doc: LeaseDoc, wall_now: float, wait: float) -> str:
    """What a daemon about to wait for another's lease says (its log, and the caller's metadata); ASCII."""
    ago = max(0.0, wall_now - doc.renewed_at)
    text = (
        f"waiting up to {wait:.0f} s for the lease of run {run} held by host {doc.host}, pid {doc.pid}, "
        f"renewed {ago:.0f} s ago"
    )
    return text.encode("ascii", "replace").decode("ascii")
