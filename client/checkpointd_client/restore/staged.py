"""Files the daemon stages on its host for a client there (RestoreFilesRequest.stage).

On the daemon's host, a save it must fetch itself (from an object store)
need not cross the connection: the daemon lands the ranges in files in its
staging dir (a tmpfs only its user may open), checking each file asked
whole against its manifest's CRC32C; the client hard-links them into a
private dir of its own (a copy where it may not link) and ends the call,
after which the daemon deletes its names for them. The client is on the
daemon's host when it finds the staging dir the header names with the stat
the header gives.
"""

from __future__ import annotations

import os
import shutil

import grpc

from checkpointd.protocol.errors import SaveFailedError
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client.transport.stream import RestoreFilesStub

Stub = checkpointd_pb2_grpc.CheckpointServiceStub | RestoreFilesStub


def stageable(header: pb.RestoreFilesHeader) -> bool:
    """Whether the daemon's staging dir is here, as the header names it (this is the daemon's host)."""
    if not header.staging_dir:
        return False
    try:
        st = os.stat(header.staging_dir)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (header.staging_device, header.staging_inode)


def take(stub: Stub, request: pb.RestoreFilesRequest, timeout: float | None, directory: str) -> None:
    """One staged call: the daemon lands the asked ranges in its staging dir; each file is linked into `directory`.

    A file already in `directory` under the same path is replaced. The
    call is ended once the files are taken, which lets the daemon delete
    its names for them.

    Raises:
        grpc.RpcError: the status that ended the call (RESOURCE_EXHAUSTED:
            no room to stage; DATA_LOSS: a stored file is corrupt).
        SaveFailedError: the daemon broke the protocol.
    """
    staged_request = pb.RestoreFilesRequest()
    staged_request.CopyFrom(request)
    staged_request.stage = True
    responses = stub.RestoreFiles(staged_request, timeout=timeout)
    try:
        first = _parsed(next(responses, None))
        if first is None or first.WhichOneof("item") != "header":
            raise SaveFailedError("the daemon's RestoreFiles answer did not start with a header")
        known = {f.path for f in first.header.files}
        second = _parsed(next(responses, None))
        if second is None or second.WhichOneof("item") != "staged":
            raise SaveFailedError("the daemon's staged RestoreFiles answer did not name its staged files")
        staged = second.staged
        for path in staged.paths:
            if path not in known:
                raise SaveFailedError(f"RestoreFiles: the daemon staged {path!r}, which its header does not list")
            target = os.path.join(directory, path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            taken = target + ".staged"
            try:
                os.link(os.path.join(staged.dir, path), taken)
            except OSError:  # another filesystem, or a link the kernel refuses: a copy (kernel-side)
                shutil.copyfile(os.path.join(staged.dir, path), taken)
            os.replace(taken, target)
    finally:
        responses.cancel()  # the daemon deletes its names for the files


def resource_exhausted(e: grpc.RpcError) -> bool:
    code = e.code() if isinstance(e, grpc.Call) else None
    return bool(code == grpc.StatusCode.RESOURCE_EXHAUSTED)


def _parsed(response: pb.RestoreFilesResponse | bytes | None) -> pb.RestoreFilesResponse | None:
    if isinstance(response, bytes):
        return pb.RestoreFilesResponse.FromString(response)
    return response
