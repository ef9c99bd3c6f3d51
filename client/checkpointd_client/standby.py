"""Standby snapshots: the trainer's newest state, handed to the daemon's host between durable saves.

A continuous `RemoteCheckpointer` on the daemon's host spends part of its
budget on durable saves and part on hand-overs (`checkpointd_client.continuous`).
A hand-over copies what changed since a slot's last snapshot into one of two
slot files in the daemon's shared-memory folder, and seals it with a record
(`checkpointd.protocol.standby`): no call, no work for the daemon. While
this process lives it holds a shared flock(2) of the first slot; once it
ends in any way (SIGKILL, the OOM killer, an uncaught exception) the daemon
writes the newest whole slot as a checkpoint of the run, unless the run
already has one as new (`checkpointd.saves.standby`). So a SIGKILL loses
about the time since the last hand-over, not since the last durable save.

The slots alternate: a process killed while copying into one leaves the
other whole. Each slot keeps its own delta (`checkpointd_client.delta`):
what changed since its own last snapshot, two hand-overs back. The slots
hold the state twice over in the host's shared memory (tmpfs); where that
does not fit (ENOSPC) hand-overs stop and durable saves go on alone.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any

from checkpointd.protocol import standby
from checkpointd_client.delta import SegmentDeltas
from checkpointd_client.tf_checkpoint import TrainingState

_LOGGER = logging.getLogger(__name__)


class _Slot:
    """One slot file, mapped; compared by identity by its deltas (`SegmentDeltas.copy_parts`)."""

    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS on a write into a hole
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self.fd = fd
        self.path = path

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass
        try:
            self.map.close()
        except BufferError:
            pass  # a view is still alive; the map goes with it
        os.close(self.fd)  # lets go of the flock too


class StandbySlots:
    """Two slots for one layout of a run's state, in one daemon's folder (see the module docstring)."""

    def __init__(self, run: str, folder: str, sizes: Sequence[int], header_bytes: int, root: Any) -> None:
        """Makes the slots in `folder` for parts of `sizes` and headers of about `header_bytes`; locks the first.

        Raises:
            OSError: they cannot be made (ENOSPC: the shared memory is full).
        """
        self.folder = folder
        self.sizes = tuple(sizes)
        self._data_offset = standby.data_offset_for(header_bytes)
        size = standby.slot_size(self._data_offset, self.sizes)
        token = secrets.token_hex(8)
        self._slots: list[_Slot] = []
        try:
            for i in range(2):
                self._slots.append(_Slot(str(PurePosixPath(folder) / f"standby-{os.getpid()}-{token}-{i}"), size))
            fcntl.flock(self._slots[0].fd, fcntl.LOCK_SH)  # held while this process lives
        except BaseException:
            self.close()
            raise
        self._deltas = [SegmentDeltas(run, root) for _ in self._slots]
        self._generation = 0
        self._next = 0  # the slot the next hand-over copies into

    @property
    def paths(self) -> list[str]:
        return [s.path for s in self._slots]

    def fits(self, folder: str, sizes: Sequence[int], header: bytes) -> bool:
        """Whether a hand-over of parts of `sizes` and `header` goes into these slots (else make new ones)."""
        return folder == self.folder and tuple(sizes) == self.sizes and standby.HEAD + len(header) <= self._data_offset

    def hand_over(self, root: Any, state: TrainingState, header: bytes) -> int:
        """Copies `state` (what changed since the slot's last snapshot) into the next slot and seals it.

        Returns:
            The bytes copied.

        Raises:
            Whatever the copy raises: that slot stays untrusted, the other one whole.
        """
        i = self._next
        slot = memoryview(self._slots[i].map)
        standby.invalidate(slot)
        views = standby.part_views(slot, self._data_offset, self.sizes)
        self._deltas[i].copy_parts(root, state, self._slots[i], views[: len(state.tensors)], strings=True)
        self._generation += 1
        standby.seal(slot, self._generation, header, self._data_offset)
        self._next = 1 - i
        copied = self._deltas[i].last
        return copied.bytes_copied if copied is not None else 0

    def close(self) -> None:
        """Removes the slots and lets go of the lock (the daemon, told first, no longer watches them)."""
        for slot in self._slots:
            slot.close()
        self._slots = []
