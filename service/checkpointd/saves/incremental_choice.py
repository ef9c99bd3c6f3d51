"""An incremental save's base and path, chosen at the accept, and what each save written teaches the choice.

At the accept of an incremental save, `SavePipeline` (`checkpointd.saves.pipeline`)
asks `IncrementalChoice.open` for the base (the checkpoint dir's newest save,
`checkpointd.saves.bases`) and the path its unchanged bytes take (copied from
the base, or received: `checkpointd.core.incremental_path.PathChooser`); once
the save is written it tells `written` (the dir's next base) and `observed`
(the path's cost).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from checkpointd.core.incremental_path import IncrementalPath, PathChooser
from checkpointd.core.ports import RemoteBases, Store, StreamingStore
from checkpointd.core.variable_manifest import VariableSpec
from checkpointd.saves import bases
from checkpointd.saves.requests import BaseOffer, SaveRequest


class IncrementalChoice:
    """Each checkpoint dir's newest save (a base), and the path each incremental save takes. Thread-safe."""

    def __init__(self, store: Store, paths: PathChooser | None) -> None:
        self._bases = bases.Newest()  # each checkpoint dir's newest save: an incremental save's base
        self._local = not isinstance(store, StreamingStore)  # an object store's saves are not files here
        self._remote_bases = store if isinstance(store, RemoteBases) else None  # copied from server-side
        # Each incremental save's path (copy from the base, or receive): the composition root
        # passes the root's own copying path (a probe found whether it clones); else copies.
        if paths is None:
            paths = PathChooser(IncrementalPath.SERVER_COPY if self._remote_bases else IncrementalPath.COPY)
        self._paths = paths
        self._paths_lock = threading.Lock()

    def open(
        self,
        store: Store,
        folder: str,
        request: SaveRequest,
        variables: Sequence[VariableSpec],
        alike: str,
        *,
        image: bool = False,
    ) -> tuple[bases.OpenBase | None, IncrementalPath]:
        """The base an incremental save copies from (None: it receives every byte; the caller closes it), its path.

        `image`: the snapshot is in a shared-memory segment laid out as its
        data file (written from memory with O_DIRECT). Its bytes are all in
        memory already, so a root that copies in the kernel (a read of the
        base and a write of the copy) is not offered the base unless the
        path was set to copy (--incremental-path copy): the image's write
        writes those bytes once and reads nothing. A root that clones its
        extents still copies.
        """
        base = bases.open_base(store, folder, request, self._local, self._bases, variables, self._remote_bases)
        in_kernel = self._paths.copies is IncrementalPath.COPY and self._paths.config.choice == "auto"
        chosen = IncrementalPath.RECEIVE if image and in_kernel and base is not None else self._path(alike, base)
        if chosen is IncrementalPath.RECEIVE and base is not None:
            base.close()  # cheaper to receive its bytes than to copy them: no base offered
            base = None
        return base, chosen

    def written(self, store: Store, folder: str, request: SaveRequest, incremental: bool) -> None:
        """A save was written: an incremental one is its dir's next base; any other leaves the dir none."""
        if incremental:
            self._bases.committed(store, folder, request)
        else:
            self._bases.forget(folder, request)

    def observed(self, alike: str, seconds: float, bytes_received: int, bytes_copied: int) -> None:
        """What a save written over `alike`'s saves cost, for the next choices."""
        with self._paths_lock:
            self._paths.observed(alike, seconds, bytes_received, bytes_copied)

    def _path(self, alike: str, base: bases.OpenBase | None) -> IncrementalPath:
        """The path of an incremental save over `alike`'s saves, given the base it found (None: no base)."""
        if base is None:
            return IncrementalPath.NO_BASE
        with self._paths_lock:
            return self._paths.choose(alike)


def alike(request: SaveRequest, shared_memory: bool) -> str:
    """The saves whose costs per byte compare: the same transport and kind, and a size within a factor of 2."""
    transport = "shm" if shared_memory else "grpc"
    return f"{transport}/{request.kind.value}/{request.snapshot_bytes.bit_length()}"


def offer(base: bases.OpenBase | None) -> BaseOffer | None:
    return None if base is None else BaseOffer(base.export_dir, base.chunk_bytes, tuple(base.offer()))
