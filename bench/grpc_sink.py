"""A bare gRPC server that swallows a client stream: the loopback limit, no checkpointd code.

`python -m bench.grpc_sink --port-file F` serves `/bench.Sink/Push`, a
client-streaming method over raw bytes (no protobuf), until SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from pathlib import Path

import grpc

METHOD = "/bench.Sink/Push"
# gRPC's default limit is 4 MiB a message; the benchmark sends 1 MiB ones.
OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]


def _push(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    total = 0
    for data in requests:
        total += len(data)
    return str(total).encode()


def serve(port_file: Path) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=OPTIONS)
    handler = grpc.method_handlers_generic_handler("bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(_push)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(port))
    tmp.replace(port_file)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(1).wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_sink", description=__doc__)
    parser.add_argument("--port-file", type=Path, required=True)
    serve(parser.parse_args(argv).port_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
