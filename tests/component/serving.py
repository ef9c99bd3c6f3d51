"""A fake CheckpointService on an in-process gRPC server, for the client's component tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures

import grpc

from checkpointd.v1 import checkpointd_pb2_grpc


@contextlib.contextmanager
def serving(servicer: checkpointd_pb2_grpc.CheckpointServiceServicer, workers: int = 2) -> Iterator[str]:
    """Serves `servicer` on a free loopback port; yields its address, stops the server on exit."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    checkpointd_pb2_grpc.add_CheckpointServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)
