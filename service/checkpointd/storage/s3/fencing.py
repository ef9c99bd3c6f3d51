"""The run's lease fence before every write request of a save, each attempt of a retried one included.

The store checks the run's lease (`fence(run)`, no request) where a commit
starts and around its manifest. Between those checks a save's uploads and
their retries can outlast the lease's ttl (a store that stalls, a daemon
paused), and a daemon that may have lost the lease must not land even a
stale save's data objects, uncommitted as they are: the run's next holder
may be writing those very keys. `WriteFence` checks the fence before each
write request (PutObject, UploadPart, UploadPartCopy, CopyObject, and the
multipart upload's create and complete) under the keys of a save the store
is writing, at botocore's `before-send`, which fires per attempt and which
`signed` emits too. A refused request raises `RunHeldError` out of the call,
untried (not a store failure: neither retried nor counted as one).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

_WRITES = frozenset(
    {"PutObject", "UploadPart", "UploadPartCopy", "CopyObject", "CreateMultipartUpload", "CompleteMultipartUpload"}
)


class WriteFence:
    """Checks `fence(run)` before each write request under a save of `run` being written. Thread-safe."""

    def __init__(self, client: Any, bucket: str, fence: Callable[[str], None]) -> None:
        self._fence = fence
        self._bucket_path = f"/{bucket}/"
        self._lock = threading.Lock()
        self._saves: dict[str, tuple[str, str]] = {}  # staging dir -> (target key, run)
        client.meta.events.register("before-send.s3", self._before_send)

    def writing(self, staging: str, target: str, run: str) -> None:
        """The save staged at `staging` goes to `target` (a dir's key, or a checkpoint's prefix) for `run`."""
        with self._lock:
            self._saves[staging] = (target, run)

    def done(self, staging: str) -> None:
        """The save staged at `staging` is committed or given up."""
        with self._lock:
            self._saves.pop(staging, None)

    def run_of(self, key: str) -> str | None:
        """The run of the save being written whose key `key` is (its dir's, or its prefix's files); else None."""
        with self._lock:
            for target, run in self._saves.values():
                if key.startswith(target) and key[len(target) : len(target) + 1] in ("/", "."):
                    return run
        return None

    def _before_send(self, event_name: str = "", request: Any = None, **_: Any) -> None:
        if request is None or event_name.rpartition(".")[2] not in _WRITES:
            return None
        path = unquote(urlsplit(request.url).path)
        at = path.find(self._bucket_path)  # path-style, under the endpoint's own path
        run = self.run_of(path[at + len(self._bucket_path) :]) if at >= 0 else None
        run = run or self.run_of(path.lstrip("/"))  # virtual-hosted: the path is the key
        if run is not None:
            self._fence(run)  # raises RunHeldError: the request is not sent
        return None  # a value here would be taken as the response
