"""The daemon's address as people write it: checked, and given the default port, by both sides.

gRPC dials port 443 for a target without one (`localhost`), where no
checkpointd listens; `with_default_port` adds the daemon's own instead. A URL
(`http://host:port`) is not a gRPC target: gRPC would try to resolve
`http` as a host name and fail with a resolver error that names neither the
address nor the fix, so `check_address` refuses it first, for the client's
savers and the CLI's `--address` alike. Stdlib only.
"""

from __future__ import annotations

DEFAULT_PORT = 7431
"""The gRPC port `checkpointd serve` binds by default, and clients dial when given none."""

# gRPC target schemes (`unix:/path`, `dns:///host:port`, ...): left as they are.
_SCHEMES = frozenset({"dns", "unix", "unix-abstract", "vsock", "ipv4", "ipv6", "xds", "google-c2p"})


class AddressError(ValueError):
    """The daemon's address cannot be dialled as written (a URL, or empty)."""


def check_address(address: str) -> str:
    """`address` stripped, if gRPC can dial it as a daemon's address.

    Accepts `host`, `host:port`, `[::1]:port` and gRPC targets with a scheme
    (`dns:///host:port`, `unix:/path`).

    Raises:
        AddressError: `address` is not a str, is empty, or is a URL (`http://host:port`,
            `grpc://host:port`); the message gives the HOST:PORT to use.
    """
    if not isinstance(address, str):
        raise AddressError(f"the daemon's address must be a str, HOST:PORT (e.g. localhost:7431), saw {address!r}")
    stripped = address.strip()
    if not stripped:
        raise AddressError("the daemon's address is empty; give it as HOST:PORT (e.g. localhost:7431)")
    scheme, sep, rest = stripped.partition("://")
    if sep and scheme.lower() not in _SCHEMES:
        host_port = rest.split("/", 1)[0] or "localhost:7431"
        raise AddressError(
            f"the daemon's address {address!r} is a URL; give its gRPC address as HOST:PORT, not a URL "
            f"(here {host_port!r})"
        )
    return stripped


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


def is_host_port(address: str) -> bool:
    """Whether a dialled address is a TCP `host:port` (not a target with a gRPC scheme)."""
    return address.partition(":")[0].lower() not in _SCHEMES and ":" in address


def split_host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a dialled TCP `host:port` or `[v6]:port`; None for anything else."""
    if not is_host_port(address):
        return None
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return None
    return host.strip("[]"), int(port)
