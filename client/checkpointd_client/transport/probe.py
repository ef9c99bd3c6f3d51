"""What listens at an address where gRPC found no daemon: an HTTP/1 server, such as the metrics port.

gRPC reports an HTTP/1 server at the address only in its error's text
("Failed parsing HTTP/2"); rather than match that, the client asks the
address itself: it sends an HTTP/1.1 request, which an HTTP/1 server (the
daemon's `--metrics-port`, a web server) answers with an `HTTP/1.x` status
line and a gRPC server with binary HTTP/2 frames or a closed connection.
"""

from __future__ import annotations

import socket

from checkpointd.protocol.address import split_host_port

_REQUEST = b"HEAD / HTTP/1.1\r\nHost: checkpointd\r\nConnection: close\r\n\r\n"
_SECONDS = 1.0


def not_grpc(address: str) -> str | None:
    """A sentence for people if `address` (a dialled `host:port`) answers HTTP/1; None otherwise.

    None also when nothing answers or the probe itself fails: the caller's
    own error says enough then. Bounded by one second.
    """
    host_port = split_host_port(address)
    if host_port is None:
        return None
    try:
        with socket.create_connection(host_port, timeout=_SECONDS) as conn:
            conn.sendall(_REQUEST)
            head = conn.recv(8)
    except OSError:
        return None
    if not head.startswith(b"HTTP/1."):
        return None
    return (
        f"{address} answers HTTP/1, so it is not checkpointd's gRPC port: the daemon's --metrics-port "
        "serves HTTP/1; give the address of its --port (7431 unless set)"
    )
