"""The daemon's address as people write it: the default port, shared by both sides.

gRPC dials port 443 for a target without one (`localhost`), where no
checkpointd listens; `with_default_port` adds the daemon's own instead.
Stdlib only.
"""

from __future__ import annotations

DEFAULT_PORT = 7431
"""The gRPC port `checkpointd serve` binds by default, and clients dial when given none."""

# gRPC target schemes (`unix:/path`, `dns:///host:port`, ...): left as they are.
_SCHEMES = frozenset({"dns", "unix", "unix-abstract", "vsock", "ipv4", "ipv6", "xds", "google-c2p"})


def with_default_port(address: str) -> str:
    """`address` with `:7431` added when it names a host but no port.

    `host` and `[::1]` get the port; `host:port`, `[::1]:port` and targets
    with a gRPC scheme are returned unchanged; a bare IPv6 address (`::1`)
    is bracketed first.
    """
    address = address.strip()
    if not address or address.partition(":")[0].lower() in _SCHEMES:
        return address
    if address.startswith("["):
        return address if "]:" in address else f"{address}:{DEFAULT_PORT}"
    if address.count(":") >= 2:  # a bare IPv6 address: its colons are not a port
        return f"[{address}]:{DEFAULT_PORT}"
    return address if ":" in address else f"{address}:{DEFAULT_PORT}"
