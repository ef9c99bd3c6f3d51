"""Restore from a committed save's files: read where the daemon keeps them, or fetched into memory.

The daemon sends the files as they are (RestoreFiles); TensorFlow's own
reader restores from them, so nothing is decoded or re-encoded:

- same host: the header names the dir the files are in on the daemon's host
  and the stat of each file the daemon checked against its manifest; if
  they are there with that stat, the restore reads them in place (no copy,
  no file byte over the connection), held open until closed
  (`checkpointd_client.restore.held_files`), so reads TensorFlow defers get the same
  bytes even if retention deletes the save meanwhile. A file replaced or
  rewritten since has another stat: it is fetched, and checked, instead.
- same host, files not local to it (an object store): the daemon lands the
  ranges in files in its staging dir on a tmpfs (ranged GETs written where
  they go, each file asked whole checked against its manifest's CRC32C by
  the daemon); the client hard-links them into a private dir of its own (a
  copy where it may not) and ends the call, so no file byte crosses the
  connection. The client knows it is on the daemon's host when it finds the
  staging dir the header names with the stat the header gives.
- elsewhere: the files are written into a private dir on tmpfs (/dev/shm,
  memory, never the trainer's disk), each file checked whole against its
  manifest's CRC32C as it lands. A partial restore fetches the index, then
  the object graph, then only the tensors under the root's children being
  restored, into a sparse data file (holes take no memory; a tensor read
  from a hole fails its CRC32C), each chunk checked against its own CRC32C.

Nothing is restored until every asked byte has arrived and been checked, so
a broken stream changes no variable.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import grpc

from checkpointd.protocol import varint, wire
from checkpointd.protocol.errors import ChecksumError, SaveFailedError
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client.restore import bundle_index, chunk_writer, held_files, staged
from checkpointd_client.transport.stream import RestoreFilesStub

_LOGGER = logging.getLogger(__name__)

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
INDEX_SUFFIX = ".index"
# Where fetched files go: memory, not the trainer's disk.
MEMORY_DIR = "/dev/shm"


@dataclass
class Fetched:
    """A save's files, ready for TensorFlow's reader.

    Attributes:
        header: the daemon's answer.
        prefix: the checkpoint prefix to restore from.
        received: file bytes received over the connection (0: read in place).
        in_place: True if the files are read where the daemon keeps them.
        index: the index file's bytes, checked against the manifest's CRC32C.
        staged: True if the daemon staged the files on this host (none received).
    """

    header: pb.RestoreFilesHeader
    prefix: str
    index: bytes
    received: int
    in_place: bool
    _dir: str | None = None
    _held: held_files.HeldFiles | None = None
    staged: bool = False

    def read(self, at: bundle_index.Location) -> bytes:
        """One tensor's bytes from the files (in place or the fetched copy)."""
        path = f"{self.prefix}.data-{at.shard:05d}-of-{self.shards:05d}"
        with open(path, "rb") as file:
            return os.pread(file.fileno(), at.size, at.offset)

    @property
    def shards(self) -> int:
        """How many data files the bundle has."""
        return sum(1 for f in self.header.files if not f.path.endswith(INDEX_SUFFIX))

    def close(self) -> None:
        """Deletes a fetched copy, or releases files read in place; idempotent."""
        if self._held is not None:
            self._held.close()
            self._held = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


Stub = checkpointd_pb2_grpc.CheckpointServiceStub | RestoreFilesStub
Write = Callable[[str, int, memoryview | bytes], None]  # (path, offset, data) of a checked chunk


def _receive(
    stub: Stub, request: pb.RestoreFilesRequest, timeout: float | None, write: Write | None
) -> tuple[pb.RestoreFilesHeader, int]:
    """One RestoreFiles call: its header, and each chunk checked and written in the order asked.

    A file asked whole is checked against its manifest's CRC32C (one pass
    over its bytes, which covers every chunk); a chunk of a partial range
    against its own.
    """
    responses = stub.RestoreFiles(request, timeout=timeout)
    try:
        first = _message(next(responses, None))
        if first is None or first.WhichOneof("item") != "header":
            raise SaveFailedError("the daemon's RestoreFiles answer did not start with a header")
        header = first.header
        files = {f.path: f for f in header.files}
        asked = [(r.path, r.offset, r.length or _size(files, r.path) - r.offset) for r in request.ranges]
        if not request.ranges and not request.header_only:
            asked = [(f.path, 0, f.size) for f in header.files]
        expected = iter([a for a in asked if a[2] > 0])  # an empty range has no chunk
        path, at, end, whole, crc = "", 0, 0, False, 0
        received = 0
        for response in responses:
            chunk = _chunk(response)
            if at == end:
                path, at, length = next(expected, ("", -1, 0))
                end, crc = at + length, 0
                whole = at == 0 and length == _size(files, path)
            if chunk is None or chunk.path != path or chunk.offset != at:
                raise SaveFailedError(f"RestoreFiles: expected a chunk of {path!r} at {at}")
            data = chunk.data
            if at + len(data) > end or not data:
                raise SaveFailedError(f"RestoreFiles: a chunk of {path!r} at {at} runs past its range")
            if whole:
                crc = wire.crc32c_of(data, crc)
            elif wire.crc32c_of(data) != chunk.crc32c:
                raise ChecksumError(f"RestoreFiles: CRC32C mismatch in {path!r} at {at}; retry the restore")
            if write is not None:
                write(path, at, data)
            at += len(data)
            received += len(data)
            if whole and at == end and crc != files[path].crc32c:
                raise ChecksumError(
                    f"{header.export_dir!r}: {path} does not match its manifest's CRC32C ({crc:08x}, "
                    f"{files[path].crc32c:08x} committed): the file is corrupt or was replaced (or the "
                    "transfer failed: retry)"
                )
        if at != end or next(expected, None) is not None:
            raise SaveFailedError(f"RestoreFiles: the stream ended before all of {path!r} arrived")
    finally:
        responses.cancel()  # a no-op once the call has ended
    return header, received


@dataclass(frozen=True)
class _Chunk:
    path: str
    offset: int
    data: memoryview | bytes
    crc32c: int


def _message(response: pb.RestoreFilesResponse | bytes | None) -> pb.RestoreFilesResponse | None:
    if isinstance(response, bytes):
        return pb.RestoreFilesResponse.FromString(response)
    return response


def _chunk(response: pb.RestoreFilesResponse | bytes) -> _Chunk | None:
    """A response's chunk, or None if it holds none; read from the serialized bytes without copying its data."""
    if not isinstance(response, bytes):
        if response.WhichOneof("item") != "chunk":
            return None
        c = response.chunk
        return _Chunk(c.path, c.offset, c.data, c.crc32c)
    raw = memoryview(response)
    if not raw or raw[0] != 0x12:  # RestoreFilesResponse.chunk = 2, length-delimited
        return None
    size, at = varint.decode(raw, 1)
    end = at + size
    path, offset, data, crc = "", 0, raw[0:0], 0
    while at < end:  # Chunk's fields, in any order, defaults omitted
        tag, at = varint.decode(raw, at)
        field, kind = tag >> 3, tag & 7
        if kind == 0:
            value, at = varint.decode(raw, at)
            offset = value if field == 2 else offset
        elif kind == 2:
            length, at = varint.decode(raw, at)
            if field == 1:
                path = bytes(raw[at : at + length]).decode()
            elif field == 3:
                data = raw[at : at + length]
            at += length
        elif kind == 5:
            crc = int.from_bytes(raw[at : at + 4], "little") if field == 4 else crc
            at += 4
        else:
            raise SaveFailedError(f"RestoreFiles: a chunk field of wire type {kind}")
    return _Chunk(path, offset, data, crc)


def _size(files: dict[str, pb.RestoreFile], path: str) -> int:
    file = files.get(path)
    if file is None:
        raise SaveFailedError(f"RestoreFiles: the header does not list {path!r}")
    return file.size


def _private_dir() -> str:
    where = MEMORY_DIR if os.path.isdir(MEMORY_DIR) and os.access(MEMORY_DIR, os.W_OK) else None
    if where is None:
        _LOGGER.warning("no writable %s: a fetched checkpoint goes to %s", MEMORY_DIR, tempfile.gettempdir())
    return tempfile.mkdtemp(prefix="checkpointd-restore-", dir=where)


def fetch(
    stub: Stub,
    run: str,
    export_dir: str,
    timeout: float | None,
    *,
    folder: str = "",
    children: Collection[str] | None = None,
    in_place: bool = True,
) -> Fetched:
    """A committed save's files for TensorFlow's reader: read in place, or fetched into memory.

    Args:
        stub: the daemon's stub.
        run, export_dir, folder: the save, as RestoreFilesRequest takes them.
        timeout: each call's deadline.
        children: the names of the checkpoint root's children being
            restored: only their tensors are fetched. None: every tensor.
        in_place: whether the files may be read where the daemon keeps them.

    Raises:
        grpc.RpcError: the status that ended a call.
        ChecksumError: a chunk or the index does not match its CRC32C.
        SaveFailedError: the daemon broke the protocol.
    """
    base = pb.RestoreFilesRequest(run=run, export_dir=export_dir, folder=folder)
    # First the header: on the daemon's host, all a restore needs; elsewhere, then the index.
    probe = pb.RestoreFilesRequest()
    probe.CopyFrom(base)
    probe.header_only = True
    header, _ = _receive(stub, probe, timeout, None)
    files = list(header.files)
    indexes = [f for f in files if f.path.endswith(INDEX_SUFFIX)]
    if len(indexes) != 1:
        raise SaveFailedError(f"RestoreFiles: {header.export_dir!r} lists {len(indexes)} index files, not 1")
    index_file = indexes[0]
    prefix_path = index_file.path[: -len(INDEX_SUFFIX)]
    held = held_files.hold(header) if in_place else None
    if held is not None:  # held open: deferred reads get these bytes even if retention deletes them
        return Fetched(header, os.path.join(held.directory, prefix_path), held.index, 0, True, _held=held)
    stage = in_place and staged.stageable(header)
    directory = _private_dir()
    writer = chunk_writer.Writer(directory, {f.path: f.size for f in files})
    try:
        request = pb.RestoreFilesRequest()
        request.CopyFrom(base)
        request.export_dir = header.export_dir  # the one the header named, even if the newest changes meanwhile
        if stage and children is None:
            try:
                staged.take(stub, request, timeout, directory)  # every file whole, each checked by the daemon
            except grpc.RpcError as e:
                if not staged.resource_exhausted(e):
                    raise
                stage = False  # no room on the daemon's tmpfs: the bytes over the connection
            else:
                index = _staged_index(directory, header, index_file)
                return Fetched(header, os.path.join(directory, prefix_path), index, 0, False, directory, staged=True)
        request.ranges.add(path=index_file.path)
        _, received = _receive(stub, request, timeout, writer)
        writer.close()
        with open(os.path.join(directory, index_file.path), "rb") as file:
            index = file.read()
        if wire.crc32c_of(index) != index_file.crc32c:
            raise ChecksumError(f"{header.export_dir!r}: its index does not match its manifest's CRC32C")
        del request.ranges[:]
        ranges, graph_bytes = _ranges(stub, request, timeout, files, index, children, writer)
        received += graph_bytes
        writer.close()
        if stage:
            staged_ranges = _with_graph(ranges, files, index)
            for path, offset, length in staged_ranges:
                request.ranges.add(path=path, offset=offset, length=length)
            try:
                staged.take(stub, request, timeout, directory)
            except grpc.RpcError as e:
                if not staged.resource_exhausted(e):
                    raise
                del request.ranges[:]
            else:
                return Fetched(
                    header, os.path.join(directory, prefix_path), index, received, False, directory, staged=True
                )
        for path, offset, length in ranges:
            request.ranges.add(path=path, offset=offset, length=length)
        _, more = _receive(stub, request, timeout, writer)
        writer.close()
        return Fetched(header, os.path.join(directory, prefix_path), index, received + more, False, directory)
    except BaseException:
        writer.abandon()
        shutil.rmtree(directory, ignore_errors=True)
        raise


def _staged_index(directory: str, header: pb.RestoreFilesHeader, index_file: pb.RestoreFile) -> bytes:
    with open(os.path.join(directory, index_file.path), "rb") as file:
        index = file.read()
    if wire.crc32c_of(index) != index_file.crc32c:
        raise ChecksumError(f"{header.export_dir!r}: its index does not match its manifest's CRC32C")
    return index


def _with_graph(
    ranges: list[tuple[str, int, int]], files: Sequence[pb.RestoreFile], index: bytes
) -> list[tuple[str, int, int]]:
    """A partial fetch's data ranges plus the object graph's: a staged data file replaces the one holding it."""
    if all(length == 0 for _, _, length in ranges):
        return ranges  # data files whole: the graph is in them
    graph_at = bundle_index.locations(index)[OBJECT_GRAPH_KEY]
    data_files = [f for f in files if not f.path.endswith(INDEX_SUFFIX)]
    shard_path = {int(f.path.rsplit("-", 3)[-3]): f.path for f in data_files}
    return [(shard_path[graph_at.shard], graph_at.offset, graph_at.size), *ranges]


def _ranges(
    stub: Stub,
    request: pb.RestoreFilesRequest,
    timeout: float | None,
    files: Sequence[pb.RestoreFile],
    index: bytes,
    children: Collection[str] | None,
    write: Write,
) -> tuple[list[tuple[str, int, int]], int]:
    """The data ranges to fetch: every data file whole, or (partial) those of the needed keys only.

    A partial fetch reads the object graph first (written into its place in
    the data file, and not fetched again), then returns the ranges of the
    tensors under `children`, adjacent ones merged, and the bytes it read.
    """
    data_files = [f for f in files if not f.path.endswith(INDEX_SUFFIX)]
    whole = [(f.path, 0, 0) for f in data_files]
    if children is None:
        return whole, 0
    locations = bundle_index.locations(index)
    graph_at = locations.get(OBJECT_GRAPH_KEY)
    if graph_at is None:
        return whole, 0
    shard_path = {int(f.path.rsplit("-", 3)[-3]): f.path for f in data_files}
    graph_file = shard_path[graph_at.shard]
    asked = pb.RestoreFilesRequest()
    asked.CopyFrom(request)
    asked.ranges.add(path=graph_file, offset=graph_at.offset, length=graph_at.size)
    graph_bytes = bytearray(graph_at.size)

    def keep(path: str, offset: int, data: memoryview | bytes) -> None:
        graph_bytes[offset - graph_at.offset : offset - graph_at.offset + len(data)] = data
        write(path, offset, data)

    _, received = _receive(stub, asked, timeout, keep)
    keys = bundle_index.needed_keys(bundle_index.string_value(bytes(graph_bytes)), children) | {OBJECT_GRAPH_KEY}
    if keys >= set(locations):
        return whole, received
    spans = sorted(
        (shard_path[loc.shard], loc.offset, loc.size)
        for k, loc in locations.items()
        if k in keys and k != OBJECT_GRAPH_KEY
    )
    merged: list[tuple[str, int, int]] = []
    for path, offset, size in spans:
        if not size:
            continue
        if merged and merged[-1][0] == path and offset <= merged[-1][1] + merged[-1][2]:
            last_path, last_offset, last_size = merged[-1]
            merged[-1] = (path, last_offset, max(last_size, offset + size - last_offset))
        else:
            merged.append((path, offset, size))
    return merged, received


def fetch_whole(stub: Stub, run: str, export_dir: str, timeout: float | None, *, folder: str = "") -> Fetched:
    """Every file a restore reads of a save (a policy's variables/ and numpy state), in place or fetched.

    Returns a Fetched whose `prefix` is the dir the files' paths are
    relative to (and no index).

    Raises:
        As `fetch`.
    """
    probe = pb.RestoreFilesRequest(run=run, export_dir=export_dir, folder=folder, header_only=True)
    header, _ = _receive(stub, probe, timeout, None)
    held = held_files.hold(header, check_index=False)
    if held is not None:
        return Fetched(header, held.directory, b"", 0, True, _held=held)
    directory = _private_dir()
    writer = chunk_writer.Writer(directory, {f.path: f.size for f in header.files})
    try:
        request = pb.RestoreFilesRequest(run=run, export_dir=header.export_dir, folder=folder)
        if staged.stageable(header):
            try:
                staged.take(stub, request, timeout, directory)  # every file whole, each checked by the daemon
            except grpc.RpcError as e:
                if not staged.resource_exhausted(e):
                    raise
            else:
                return Fetched(header, directory, b"", 0, False, directory, staged=True)
        _, received = _receive(stub, request, timeout, writer)  # every file whole, each checked
        writer.close()
        return Fetched(header, directory, b"", received, False, directory)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    finally:
        writer.abandon()
