"""Reads a committed save's values back, for Restore.

A save's `variables/variables` checkpoint holds the run's variables under the
SavedModel's keys (a SAVED_MODEL save) or under `PolicySaver.save_checkpoint`'s
keys (a CHECKPOINT save); the run's manifest names both. The reader checks that
the checkpoint holds exactly the manifest's variables, with their dtypes and
shapes, before anything is sent, then yields each value's raw little-endian
C-order bytes in manifest order, one tensor in memory at a time, followed by
the numpy state's entries (see `checkpointd.formats.numpy_files`).

The checkpoints are read by the daemon's own `checkpointd.bundle.reader`,
each tensor's CRC32C checked as it is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from checkpointd.bundle.reader import BundleReader, CorruptBundleError, UnreadableBundleError
from checkpointd.core.numpy_state import NumpyStateSpec
from checkpointd.core.variable_manifest import Manifest
from checkpointd.formats import numpy_files
from checkpointd.formats.policy_template import VARIABLES_PREFIX
from checkpointd.protocol.errors import ChecksumError, InvalidRequestError, SaveFailedError, describe
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.tensors import OBJECT_GRAPH_KEY


@dataclass
class SaveValues:
    """An opened save whose keys matched the run's manifest.

    Attributes:
        manifest: the run's manifest, in payload order.
        numpy_state: the save's numpy state, or None.
        nbytes: the payload's size (variables plus numpy entries).
    """

    manifest: Manifest
    numpy_state: NumpyStateSpec | None
    nbytes: int
    _reader: BundleReader
    _keys: tuple[str, ...]
    _numpy_values: tuple[bytes, ...]
    _where: str

    def pieces(self) -> Iterator[memoryview]:
        """Each variable's bytes in manifest order, then each numpy entry's.

        Raises:
            ChecksumError: a tensor fails its CRC32C on disk.
            SaveFailedError: a tensor could not be read (e.g. the save was
                replaced while it was being read).
        """
        for key in self._keys:
            try:
                value = self._reader.raw(key)
            except CorruptBundleError as e:
                raise ChecksumError(f"{self._where}: {key!r} is corrupt ({describe(e)})") from None
            except UnreadableBundleError as e:
                raise SaveFailedError(f"{self._where}: could not read {key!r} ({describe(e)})") from None
            yield memoryview(value)
        for value in self._numpy_values:
            yield memoryview(value)


def open_save(save_dir: Path, kind: SaveKind, manifest: Manifest, where: str) -> SaveValues:
    """Opens a save's checkpoints and checks them against the run's manifest.

    Args:
        save_dir: the committed save.
        kind: its kind (from its save manifest): which keys to expect.
        manifest: the run's manifest.
        where: how to name the save in errors (its export dir).

    Returns:
        The save, ready to stream.

    Raises:
        InvalidRequestError: naming the first key the save lacks, has in
            excess, or holds with another dtype or shape than the manifest.
        ChecksumError, SaveFailedError: its files are corrupt or unreadable.
    """
    try:
        reader = BundleReader(VARIABLES_PREFIX, below=os.fspath(save_dir))  # no link below the save's dir followed
        shapes = {key: t.shape for key, t in reader.tensors.items()}
        dtypes = {key: t.dtype for key, t in reader.tensors.items()}
        numpy_state = numpy_files.read(Path(save_dir))
    except CorruptBundleError as e:
        raise ChecksumError(f"{where}: its checkpoint is corrupt ({describe(e)})") from None
    except UnreadableBundleError as e:
        raise SaveFailedError(f"{where}: its checkpoint is unreadable ({describe(e)})") from None
    keys = tuple(v.key if kind is SaveKind.SAVED_MODEL else v.checkpoint_key for v in manifest.variables)
    for key, v in zip(keys, manifest.variables, strict=True):
        if key not in shapes:
            raise InvalidRequestError(
                f"{where}: the save has no {key!r}, which the run's manifest has; was it " "written by another policy?"
            )
        if dtypes[key] != v.dtype or shapes[key] != v.shape:
            raise InvalidRequestError(
                f"{where}: {key!r} is {dtypes[key]}{list(shapes[key])} in the save; the "
                f"run's manifest has {v.dtype}{list(v.shape)}"
            )
    extra = set(shapes) - set(keys) - {OBJECT_GRAPH_KEY}
    if extra:
        raise InvalidRequestError(
            f"{where}: the save has {min(extra)!r}, which the run's manifest lacks; was it "
            "written by another policy?"
        )
    return SaveValues(
        manifest=manifest,
        numpy_state=numpy_state.spec if numpy_state else None,
        nbytes=manifest.nbytes + (numpy_state.spec.nbytes if numpy_state else 0),
        _reader=reader,
        _keys=keys,
        _numpy_values=numpy_state.values if numpy_state else (),
        _where=where,
    )
