"""The trainer's side of the shared-memory transport (see `checkpointd.transport.shm`).

When the daemon's accept offers its run segment, the snapshot is copied
straight into the mapped segment and the Save call carries one
`shared_memory_written` instead of the chunks. The map is kept while the
daemon offers the same segment, so each save copies into memory already
touched. A segment that cannot be opened (the daemon is on another host, in
another container, or runs as another user) turns shared memory off for the
saver; its saves then go over gRPC.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client.numpy_state import NumpySnapshot
from checkpointd_client.snapshot import Bindings, Snapshot, take_snapshot

_LOGGER = logging.getLogger(__name__)
# MAP_POPULATE (Linux) maps every page at once instead of faulting one by one.
_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class SegmentMap:
    """The daemon's segment for a run, mapped in this process."""

    def __init__(self, offer: pb.SharedMemory) -> None:
        """Maps the offered segment.

        Raises:
            OSError: it cannot be opened or mapped, or its size is not the offer's.
        """
        fd = os.open(offer.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size != offer.size:
                raise OSError(f"{offer.path} has {size} bytes, the daemon offered {offer.size}")
            # Faulted in now, once: later snapshots copy at memcpy speed.
            self._map = mmap.mmap(fd, size, flags=_FLAGS)
        finally:
            os.close(fd)
        self.path = offer.path
        self.offsets = tuple(offer.offsets)
        # Each variable's array over the segment, made once per bindings.
        self._arrays: tuple[Bindings, list[np.ndarray]] | None = None

    def view(self) -> memoryview:
        """The whole mapped segment, writable in place."""
        return memoryview(self._map)

    def matches(self, offer: pb.SharedMemory) -> bool:
        return self.path == offer.path and self.offsets == tuple(offer.offsets)

    def snapshot(
        self,
        bindings: Bindings,
        train_step: tf.Variable,
        numpy_state: NumpySnapshot | None,
        values: Sequence[np.ndarray] | None = None,
    ) -> Snapshot:
        """Copies the bound variables (and the numpy state) into the segment now.

        `values`: as for `take_snapshot` (a graph-mode policy's values, read in one session run).

        Raises:
            ValueError: the offer's layout does not fit the bindings.
        """
        variables = bindings.variables
        if len(self.offsets) != len(variables) + 1:
            raise ValueError(
                f"the daemon's segment has {len(self.offsets)} parts; the snapshot has " f"{len(variables) + 1}"
            )
        whole = memoryview(self._map)
        if self._arrays is None or self._arrays[0] is not bindings:
            self._arrays = (bindings, [
                np.frombuffer(whole, tf.as_dtype(b.dtype).as_numpy_dtype, math.prod(b.shape), offset)
                .reshape(b.shape)
                for b, offset in zip(variables, self.offsets, strict=False)
            ])  # fmt: skip
        arrays = self._arrays[1]
        snap = take_snapshot(bindings, train_step, numpy_state=numpy_state, into=arrays, values=values)
        for copied, target in zip(snap.arrays, arrays, strict=True):
            # little_endian() hands back the array itself; anything else is a
            # byte-swapped copy (a big-endian host).
            if copied is not target:
                target.view(np.uint8).reshape(-1)[:] = copied.view(np.uint8).reshape(-1)
        if numpy_state is not None:
            at = self.offsets[-1]
            for value in numpy_state.values:
                whole[at : at + len(value)] = value
                at += len(value)
        return snap


def open_offer(offer: pb.SharedMemory, current: SegmentMap | None, run: str) -> SegmentMap | None:
    """`current` if it is the offered segment, else a new map of it; None if it cannot be mapped."""
    if current is not None and current.matches(offer):
        return current
    try:
        return SegmentMap(offer)
    except OSError as e:
        _LOGGER.info(
            "run %s: the daemon's shared memory %s cannot be used here (%s); " "snapshots go over gRPC",
            run,
            offer.path,
            e.strerror or e,
        )
        return None
