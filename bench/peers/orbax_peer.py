"""The Orbax side of `bench.peers.orbax`: run by path with the Orbax venv's Python, never imported by the bench.

`.venv-orbax/bin/python bench/peers/orbax_peer.py DIR` holds a pytree of JAX
arrays and an async `orbax.checkpoint.CheckpointManager` writing under DIR,
and answers the bench over a pipe: one JSON object a line on stdin, one
JSON reply a line on stdout (everything JAX and Orbax print goes to stderr).
It imports only the standard library, NumPy, JAX and Orbax, so that it runs
in a venv without TensorFlow or checkpointd.

Requests:
- `{"op": "build", "arrays": [{"name", "shape", "dtype", "change"}], "seed": S}`:
  the arrays, filled as the bench fills its own (see `bench.peers.orbax.fill`);
  `change` says what a save's change rewrites: "all" every value, "rows" the
  rows given with the save, "none" nothing. Reply: the bytes held, versions.
- `{"op": "save", "step": N, "rows": [start, n] | null}`: the change (every
  "all" array + 1, the rows [start, start + n) modulo the rows of each "rows"
  array + 1, each array ready before the clock starts), then
  `manager.save(N)` (the stall), `wait_until_finished()` (finished), and
  every file and dir of the step fsynced (durable: Orbax does not fsync).
  Reply: those three in seconds and the step's bytes on disk.
- `{"op": "close"}`: closes the manager and exits.
A failed request's reply is `{"error": "..."}` and the process exits 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

# Run by path, this file's dir (bench/peers/, which holds orbax.py) would shadow the `orbax` package.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]


def fill(shape: list[int], dtype: str, seed: int) -> Any:
    """An array's first values, the same on both sides: normal floats, integers over the dtype's range.

    Random, so that neither side's file format compresses them away (Orbax's compresses by default).
    """
    import numpy as np

    kind, rng = np.dtype(dtype), np.random.default_rng(seed)
    if kind.kind == "f":
        return rng.standard_normal(tuple(shape), dtype=np.float32).astype(kind)
    high = 1 << (kind.itemsize * 8 - (kind.kind == "i"))
    return rng.integers(0, min(high, 1 << 62), tuple(shape)).astype(kind)


def ring_spans(start: int, n: int, rows: int) -> list[tuple[int, int]]:
    """The [lo, hi) ranges that rows start, start + 1, ... start + n - 1 modulo `rows` cover, as a ring buffer
    writes them."""
    if not 0 <= n <= rows or not 0 <= start < rows:
        raise ValueError(f"{n} rows from row {start} of {rows}")
    spans = [(start, min(start + n, rows)), (0, start + n - rows)]
    return [(lo, hi) for lo, hi in spans if hi > lo]


def _fsync_tree(top: str) -> int:
    """fsyncs every file and dir under `top`, then `top`'s parent; returns the bytes of the files."""
    total = 0
    for here, _dirs, files in os.walk(top):
        for name in files:
            path = os.path.join(here, name)
            total += os.path.getsize(path)
            _fsync(path)
        _fsync(here)
    _fsync(os.path.dirname(top))  # the rename that published the step
    return total


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Peer:
    def __init__(self, directory: str) -> None:
        import jax

        jax.config.update("jax_enable_x64", True)  # int64 columns stay int64, as in the bench's state
        import orbax.checkpoint as ocp

        self._jax, self._ocp, self._dir = jax, ocp, directory
        self._manager = ocp.CheckpointManager(
            directory, options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
        )
        self._tree: dict[str, Any] = {}
        self._change: dict[str, str] = {}

    def build(self, arrays: list[dict[str, Any]], seed: int) -> dict[str, Any]:
        import jax.numpy as jnp

        for i, spec in enumerate(arrays):
            self._tree[spec["name"]] = jnp.asarray(fill(spec["shape"], spec["dtype"], seed + i)).block_until_ready()
            self._change[spec["name"]] = spec["change"]
        nbytes = sum(int(a.nbytes) for a in self._tree.values())
        versions = {"jax": self._jax.__version__, "orbax_checkpoint": self._ocp.__version__}
        return {"bytes": nbytes, "arrays": len(self._tree), "versions": versions}

    def save(self, step: int, rows: list[int] | None) -> dict[str, Any]:
        for name, how in self._change.items():
            a = self._tree[name]
            if how == "all":
                a = a + 1
            elif how == "rows" and rows is not None:
                for lo, hi in ring_spans(rows[0], rows[1], a.shape[0]):
                    a = a.at[lo:hi].add(1)
            self._tree[name] = a.block_until_ready()
        started = time.perf_counter()
        self._manager.save(step, args=self._ocp.args.StandardSave(self._tree))
        stall = time.perf_counter() - started
        self._manager.wait_until_finished()
        finished = time.perf_counter() - started
        on_disk = _fsync_tree(os.path.join(self._dir, str(step)))
        durable = time.perf_counter() - started
        return {"stall": stall, "finished": finished, "durable": durable, "bytes_on_disk": on_disk}

    def close(self) -> dict[str, Any]:
        self._manager.close()
        return {"closed": True}


def main() -> int:
    # The replies' channel is the stdout the bench reads; anything else printed goes to stderr.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    peer = _Peer(sys.argv[1])
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "build":
                reply = peer.build(request["arrays"], request["seed"])
            elif request["op"] == "save":
                reply = peer.save(request["step"], request.get("rows"))
            elif request["op"] == "close":
                replies.write(json.dumps(peer.close()) + "\n")
                return 0
            else:
                raise ValueError(f"unknown op {request['op']!r}")
        except Exception as e:
            traceback.print_exc()
            replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
            return 1
        replies.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
