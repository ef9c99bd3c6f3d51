"""Binding the gRPC port: grpcio's failures said with the flags that fix them and the OS's reason."""

from __future__ import annotations

import errno
import os
import socket
import sys
import tempfile
from collections.abc import Callable

from checkpointd.protocol.errors import describe


def bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def bind_failure(what: str, host: str, port: int, e: OSError, flags: tuple[str, str], port_help: str) -> OSError:
    """A bind failure said with the flags that fix it and the OS's reason."""
    host_flag, port_flag = flags
    if isinstance(e, socket.gaierror):
        return OSError(f"cannot resolve {host_flag} {host!r} for {what}: {e.strerror}")
    reason = describe(e)
    if e.errno == errno.EADDRINUSE:
        reason += f": another process has port {port}; stop it, or choose another {port_flag} ({port_help})"
    elif e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
        reason += f": {host} is not an address of this machine (check {host_flag})"
    return OSError(f"cannot bind {what} to {bracket(host)}:{port}: {reason}")


def bind_quietly(bind: Callable[[], int]) -> int:
    """Runs gRPC's bind, returning its port (0 if it failed), without grpcio's own lines when it fails.

    grpcio's C core writes its failure to fd 2 ("Failed to add port to
    server", after absl's note on logging before InitializeLog), which says
    less than the message the caller then makes (`bind_error`). What fd 2
    got meanwhile is kept and written out if the bind succeeded (other
    threads' output included), and dropped with the failure.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            port = bind()
        except RuntimeError:  # grpcio raises where its docs say it returns 0
            port = 0
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        if port:
            held.seek(0)
            os.write(2, held.read())
    return port


def bind_error(host: str, port: int) -> OSError:
    """Why gRPC could not bind host:port; grpcio says only that it failed.

    Resolves the host and binds a probe socket to each address, so the
    message carries the OS's reason (address in use, cannot assign, no
    such host); gRPC has already failed, so the probe takes nothing from it.
    """
    flags, port_help = ("--host", "--port"), "0 picks a free one"
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, sockaddr in addresses:
            with socket.socket(family, kind, proto) as probe:
                probe.bind(sockaddr)
    except OSError as e:
        return bind_failure("gRPC", host, port, e, flags, port_help)
    return OSError(f"cannot bind gRPC to {bracket(host)}:{port}: gRPC refused the address (check --host)")
