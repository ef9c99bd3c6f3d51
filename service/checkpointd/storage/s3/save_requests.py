"""Every request of a save being written, each attempt of a retried one: fenced by the run's lease, bounded by the save's deadline.

The store checks the run's lease (`fence(run)`, no request) where a commit
starts and around its manifest. Between those checks a save's uploads and
their retries can outlast the lease's ttl (a store that stalls, a daemon
paused), and a daemon that may have lost the lease must not land even a
stale save's data objects, uncommitted as they are: the run's next holder
may be writing those very keys. And botocore retries a failed request on its
own schedule, whatever the caller's deadline.

`SaveRequests` hooks botocore's per-attempt events (`signed` emits them
too), and knows the saves being written (`writing`: staging dir, target
key, run, deadline), so it finds a request's save from its key:

- before each attempt (`before-send`): a write (PutObject, UploadPart,
  UploadPartCopy, CopyObject, the multipart upload's create and complete)
  goes out only while the run's lease is valid (else `RunHeldError`), and
  no request of a save goes out past its deadline;
- after each failed attempt (`needs-retry`, `signed.FAILED_ATTEMPT`): the
  error is kept as the save's last, and past the deadline there is no retry.

A save's requests made before it is accepted (a check of what is at its
place) are the RPC thread's own: `bounded(deadline)` bounds every request
the calling thread makes inside the block the same way.

Past the deadline the call raises `SaveDeadlineError`, naming the last
error; the store reports it as UNAVAILABLE. Neither refusal is a store
failure: not retried, not counted as one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from checkpointd.protocol.errors import RunHeldError
from checkpointd.storage.s3 import signed

_WRITES = frozenset(
    {"PutObject", "UploadPart", "UploadPartCopy", "CopyObject", "CreateMultipartUpload", "CompleteMultipartUpload"}
)


class SaveDeadlineError(Exception):
    """A save's request was not sent or retried: the save's deadline had passed."""


@dataclass
class _Save:
    target: str  # a dir's key, or a checkpoint's prefix
    run: str
    deadline: float | None  # time.monotonic()
    last_error: str = ""


class SaveRequests:
    """Fences and bounds each request of the saves being written. Thread-safe."""

    def __init__(
        self, client: Any, bucket: str, fence: Callable[[str], None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._fence, self._clock = fence, clock
        self._bucket_path = f"/{bucket}/"
        self._lock = threading.Lock()
        self._saves: dict[str, _Save] = {}  # by staging dir
        self._thread = threading.local()  # .save: the _Save of `bounded`, for this thread's requests
        client.meta.events.register("before-send.s3", self._before_send)
        client.meta.events.register("needs-retry.s3", self._after_attempt)
        client.meta.events.register(signed.FAILED_ATTEMPT, self._signed_failed)

    def writing(self, staging: str, target: str, run: str, deadline: float | None) -> None:
        """The save staged at `staging` goes to `target` for `run`, until `deadline` (monotonic; None: none)."""
        with self._lock:
            self._saves[staging] = _Save(target, run, deadline)

    @contextlib.contextmanager
    def bounded(self, deadline: float | None) -> Iterator[None]:
        """No request this thread makes inside the block is sent or retried past `deadline` (monotonic; None: none)."""
        outer = getattr(self._thread, "save", None)
        self._thread.save = _Save("", "", deadline) if deadline is not None else None
        try:
            yield
        finally:
            self._thread.save = outer

    def done(self, staging: str) -> None:
        """The save staged at `staging` is committed or given up."""
        with self._lock:
            self._saves.pop(staging, None)

    def run_of(self, key: str) -> str | None:
        """The run of the save being written whose key `key` is (its dir's, or its prefix's files); else None."""
        save = self._save_of(key)
        return save.run if save is not None else None

    def _signed_failed(self, event_name: str = "", url: str = "", why: str = "", **_: Any) -> None:
        """A failed attempt of `signed` (botocore does not see those): the save's last error; past its deadline, no retry."""
        save = self._save_of_url(url) if url else None
        if save is not None:
            operation = event_name.rpartition(".")[2]
            save.last_error = f"{operation}: {why}"
            self._past_deadline(save, operation)

    def _save_of(self, key: str) -> _Save | None:
        with self._lock:
            for save in self._saves.values():
                target = save.target
                if key.startswith(target) and key[len(target) : len(target) + 1] in ("/", "."):
                    return save
        return None

    def _save_of_url(self, url: str) -> _Save | None:
        """The save being written that a request to `url` is of; else this thread's `bounded` block's, if any."""
        path = unquote(urlsplit(url).path)
        at = path.find(self._bucket_path)  # path-style, under the endpoint's own path
        found = self._save_of(path[at + len(self._bucket_path) :]) if at >= 0 else None
        found = found or self._save_of(path.lstrip("/"))  # virtual-hosted: the path is the key
        return found or getattr(self._thread, "save", None)

    def _past_deadline(self, save: _Save, operation: str) -> None:
        if save.deadline is not None and self._clock() >= save.deadline:
            raise SaveDeadlineError(
                f"the save's deadline passed before {operation} could be "
                f"{'retried' if save.last_error else 'sent'}; last error: {save.last_error or 'none'}"
            )

    def _before_send(self, event_name: str = "", request: Any = None, **_: Any) -> None:
        operation = event_name.rpartition(".")[2]
        save = self._save_of_url(request.url) if request is not None else None
        if save is None:
            return None
        self._past_deadline(save, operation)
        if operation in _WRITES and save.run:
            self._fence(save.run)  # raises RunHeldError: the request is not sent
        return None  # a value here would be taken as the response

    def _after_attempt(
        self,
        event_name: str = "",
        response: Any = None,
        caught_exception: Any = None,
        request_dict: Any = None,
        **_: Any,
    ) -> None:
        url = request_dict.get("url", "") if isinstance(request_dict, dict) else ""
        save = self._save_of_url(url) if url else None
        if save is None or isinstance(caught_exception, (SaveDeadlineError, RunHeldError)):
            return None  # not this store's save, or refused here before it was sent (not retried)
        operation = event_name.rpartition(".")[2]
        parsed = response[1] if isinstance(response, tuple) and len(response) > 1 else {}
        status = int(parsed.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if caught_exception is not None:
            save.last_error = f"{operation}: {caught_exception}"
        elif status >= 500:
            code = parsed.get("Error", {}).get("Code", "")
            save.last_error = f"{operation}: HTTP {status} {code}".rstrip()
        else:
            return None  # answered: nothing to retry
        self._past_deadline(save, operation)  # no retry past it
        return None  # botocore's retry handler decides the rest
