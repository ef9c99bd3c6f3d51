"""The daemon runs of a training job: one per saver, named from the job and what the saver writes.

A run on the daemon is one saver's stream of saves (the proto's "What a run
is"): skip-if-busy applies within it, as `AsyncPolicySaver`'s applies within
one saver, so the savers and checkpointers of one script never skip, refuse
or shadow one another. A script names its job once (`run=`, which is also
the folder its saves share unless `folder=` says otherwise); each drop-in
derives its own daemon run from it:

| drop-in | daemon run | where, under `<root>/<folder>/` |
|---|---|---|
| `RemoteCheckpointer(ckpt_dir)` | `<job>.<ckpt_dir, '/' as '.'>` | `<ckpt_dir>/ckpt-<step>.*` |
| `RemotePolicySaver(policy)` | `<job>`; while another policy's saver of the job is open in this process, `<job>.<policy's name>` | each save's `export_dir` |

The names are the same at every start of the same script, so a restarted
trainer registers the same runs again. Restores go by where the checkpoints
are (a checkpointer's folder and dir), so a job renamed over an existing
dir resumes from it. No TensorFlow here.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import threading
import weakref
from typing import Any

from checkpointd.protocol.names import check_run_name

_MAX_RUN = 128  # a run name's most characters (checkpointd.protocol.names)
_PLAIN = re.compile(r"[A-Za-z0-9_-]+")
_DIGEST_CHARS = 12


def job_name(run: str | None, folder: str | None) -> str:
    """The job's name: `run`, else `folder` (both checked as run names).

    Raises:
        ValueError: neither is given, or one is not a valid run name (naming the argument).
    """
    if run is None and folder is None:
        raise ValueError(
            "name the training job: run='cartpole-dqn' (also its folder on the daemon, unless folder= says "
            "otherwise); every saver and checkpointer of the script takes the same run="
        )
    for argument, value in (("run", run), ("folder", folder)):
        if value is not None:
            try:
                check_run_name(value)
            except Exception as e:  # InvalidRequestError: the daemon's words, the argument's name
                raise ValueError(f"{argument}={value!r}: {e}") from None
    return run if run is not None else folder  # type: ignore[return-value]  # one of them is set


def checkpointer_run(job: str, ckpt_dir: str) -> str:
    """The daemon run of a job's checkpointer of `ckpt_dir` (normalized, '/'-separated).

    `<job>.<parts of ckpt_dir joined by '.'>` when every part is plain
    ([A-Za-z0-9_-]) and the name fits; else `<job>.<digest of ckpt_dir>`,
    so two dirs never share a run.
    """
    parts = ckpt_dir.split("/")
    if all(_PLAIN.fullmatch(p) for p in parts):
        name = ".".join((job, *parts))
        if len(name) <= _MAX_RUN:
            return name
    digest = hashlib.sha256(ckpt_dir.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]
    return f"{job[: _MAX_RUN - _DIGEST_CHARS - 1]}.{digest}"


def relative_to(path: str | os.PathLike[str], root_dir: str | os.PathLike[str] | None) -> str:
    """`path` as the daemon names it: relative to `root_dir` (when given), '/'-separated.

    TF-Agents scripts build their checkpoint dirs under a local `root_dir`
    (`os.path.join(root_dir, 'train')`); the daemon keeps the same layout
    under the job's folder.

    Raises:
        ValueError: `path` is absolute and not under `root_dir`, or leaves it.
    """
    path = os.fspath(path)
    if root_dir is not None and os.path.isabs(path) == os.path.isabs(os.fspath(root_dir)):
        path = os.path.relpath(path, root_dir)
    relative = path.replace(os.sep, "/")
    if posixpath.isabs(relative) or relative.split("/")[0] == "..":
        raise ValueError(
            f"{path!r} is not under root_dir {os.fspath(root_dir) if root_dir else None!r}: checkpointd saves "
            "under the run's folder on the daemon, so give paths relative to it (or under root_dir)"
        )
    return relative


class PolicyRuns:
    """The policy savers' runs open in this process, so that two policies' savers of one job never share a run.

    A saver of the same policy object takes the same run (a trainer that
    builds its saver again); a saver of another policy, while the first is
    open, takes `<job>.<its policy's name>` (then `-2`, `-3`, ...).
    Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str, str], weakref.ref[Any]] = {}  # (address, folder, run) -> policy

    def take(self, address: str, folder: str, job: str, policy: Any) -> str:
        """The run for a new saver of `policy` in `job`, held until `release`."""
        with self._lock:
            name = job
            if not self._free(address, folder, name, policy):
                base = checkpointer_run(job, _plain(getattr(policy, "name", None) or "policy"))
                name, n = base, 2
                while not self._free(address, folder, name, policy):
                    name, n = f"{base}-{n}", n + 1
            self._open[(address, folder, name)] = weakref.ref(policy)
            return name

    def release(self, address: str, folder: str, run: str, policy: Any) -> None:
        """Lets go of a run `take` gave `policy`'s saver (a closed saver)."""
        with self._lock:
            ref = self._open.get((address, folder, run))
            if ref is not None and ref() in (policy, None):
                del self._open[(address, folder, run)]

    def _free(self, address: str, folder: str, run: str, policy: Any) -> bool:
        ref = self._open.get((address, folder, run))
        holder = ref() if ref is not None else None
        return holder is None or holder is policy


def _plain(name: str) -> str:
    """A policy's name as one plain part of a run name."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name) or "policy"


POLICY_RUNS = PolicyRuns()
"""The process's policy savers' runs."""
