"""GetLatest and Restore: a run's committed saves, found on disk and streamed back.

The servicer's two handlers delegate here. `latest_response` needs no
TensorFlow (manifests only); `restore_responses` opens the save with
`checkpointd.formats.reader` and streams it the way a Save's snapshot arrives: a header
naming the variables (the run's manifest order) and the numpy state, then the
payload as Chunks of at most `chunk_bytes`, each with its CRC32C, at offsets
over the whole payload.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import crc32c

from checkpointd.saves import catalog
from checkpointd.formats import reader
from checkpointd.protocol.errors import RunNotFoundError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.core.manifest import Manifest
from checkpointd.core.numpy_state import NumpyStateSpec
from checkpointd.v1 import checkpointd_pb2 as pb

_LOGGER = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
_KIND_TO_PB = {SaveKind.SAVED_MODEL: pb.SAVED_MODEL, SaveKind.CHECKPOINT: pb.CHECKPOINT}


def numpy_state_to_pb(spec: NumpyStateSpec) -> pb.NumpyState:
    return pb.NumpyState(
        object_graph=spec.object_graph,
        entries=[pb.NumpyStateEntry(checkpoint_key=e.checkpoint_key, nbytes=e.nbytes) for e in spec.entries],
    )


def latest_response(root: Path, folder: str, run: str, kind: SaveKind | None) -> pb.LatestResponse:
    """GetLatest's answer: the run's newest committed save under `<root>/<folder>`."""
    save = catalog.find_latest(root, folder, run, kind)
    if save is None:
        return pb.LatestResponse(found=False)
    return pb.LatestResponse(
        found=True,
        path=str(save.path),
        export_dir=save.export_dir,
        step=save.step,
        kind=_KIND_TO_PB[save.kind],
        unix_seconds=save.created,
    )


def restore_responses(
    root: Path,
    folder: str,
    run: str,
    export_dir: str,
    manifest: Manifest,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[pb.RestoreResponse]:
    """Restore's answer: a header, then the save's values as chunks.

    Everything is checked before the header is yielded, so an error ends the
    call with a status and no partial answer.

    Args:
        root: the daemon's root.
        folder: the run's folder.
        run: the run (registered; `manifest` is its manifest).
        export_dir: the save to read, relative to the folder; empty for the
            run's newest committed save.
        manifest: the run's manifest: which keys to read, in payload order.
        chunk_bytes: the largest payload of one chunk.

    Raises:
        RunNotFoundError: the run has no committed save (at `export_dir`).
        InvalidRequestError: `export_dir` is invalid, or the save's keys do
            not match the manifest (the message names the first one).
        ChecksumError, SaveFailedError: the save is corrupt or unreadable.
    """
    started = time.monotonic()
    if export_dir:
        save = catalog.committed_save(root, folder, export_dir)
    else:
        found = catalog.find_latest(root, folder, run)
        if found is None:
            raise RunNotFoundError(
                f"run {run!r} has no committed save in {Path(root) / folder} to restore"
            )
        save = found
    values = reader.open_save(save.path, save.kind, manifest, repr(save.export_dir))
    header = pb.RestoreHeader(
        export_dir=save.export_dir,
        step=save.step,
        kind=_KIND_TO_PB[save.kind],
        variables=[
            pb.Variable(key=v.key, checkpoint_key=v.checkpoint_key, dtype=v.dtype, shape=v.shape)
            for v in manifest.variables
        ],
        snapshot_bytes=values.nbytes,
        path=str(save.path),
        unix_seconds=save.created,
    )
    if values.numpy_state is not None:
        header.numpy_state.CopyFrom(numpy_state_to_pb(values.numpy_state))
    yield pb.RestoreResponse(header=header)
    offset = 0
    for piece in values.pieces():
        for start in range(0, len(piece), chunk_bytes):
            data = bytes(piece[start : start + chunk_bytes])
            yield pb.RestoreResponse(chunk=pb.Chunk(offset=offset, data=data, crc32c=crc32c.crc32c(data)))
            offset += len(data)
    _LOGGER.info(
        "restored run=%s kind=%s export_dir=%s step=%d bytes=%d in %.3fs",
        run, save.kind.value, save.export_dir, save.step, offset, time.monotonic() - started,
    )
