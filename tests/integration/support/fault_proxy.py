"""A TCP proxy in front of the S3 server that fails on command: refuse, reset, answer 503/500, or stall.

`FaultProxy(upstream)` listens on 127.0.0.1:0 (`endpoint` is its URL) and
forwards every connection to `upstream` (radosgw). `fault(kind)` switches
every connection from then on, and those already open, to one way of failing:

- `refuse`: the listening socket is closed, so connects are refused
  (ECONNREFUSED); open connections are reset.
- `reset`: a connection is reset (RST) once `reset_after` more bytes have
  gone towards the server on it: mid-body for any upload larger than that.
- `slowdown` / `internal`: each new request is answered `503 SlowDown` or
  `500 InternalError` with S3's XML error body, then the connection closed;
  open connections are reset when the fault begins (a server restarted into
  that state).
- `stall`: connections are accepted and whatever is sent is read and
  dropped; nothing is ever answered. A connection that lost bytes so stays
  stalled after the fault ends, until the client gives up on it: only the
  client's own timeout frees it. Idle ones forward again.

`fault(kind, only=PATTERN)` fails only the requests whose request line
(`GET /bucket/key?query HTTP/1.1`) PATTERN matches (`re.search`), on any
connection, and forwards the rest: `reset` resets the connection at the
request's head, `stall` drops it and all that follows on its connection,
`slowdown`/`internal` answer it. Request heads are found by following each
connection's Content-Length bodies (what botocore sends).

`clear()` forwards again; `during(kind)` is a fault for the block. A context manager: `close()` stops the listener and every
connection, and joins its (daemon) threads.
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from urllib.parse import urlsplit

KINDS = ("refuse", "reset", "slowdown", "internal", "stall")
_ERRORS = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "internal": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
}
_POLL = 0.05  # seconds a connection's loop waits before it looks at the fault again


def _reset(sock: socket.socket) -> None:
    """Closes `sock` with an RST, not a FIN (SO_LINGER 0)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def error_response(kind: str) -> bytes:
    """The HTTP response S3 gives for `kind` ("slowdown" or "internal"), closing the connection."""
    status, reason, code, message = _ERRORS[kind]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head + body


class FaultProxy:
    """Forwards 127.0.0.1:<port> to `upstream` (an http://host:port URL), failing on command. Thread-safe."""

    def __init__(self, upstream: str, reset_after: int = 64 << 10) -> None:
        url = urlsplit(upstream)
        assert url.hostname is not None and url.port is not None, upstream
        self._upstream = (url.hostname, url.port)
        self.reset_after = reset_after
        self._lock = threading.Lock()
        self._kind: str | None = None
        self._only: re.Pattern[bytes] | None = None  # the requests a targeted fault fails
        self._generation = 0  # bumped at each fault change; connections compare theirs
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self.counts: dict[str, int] = {"connections": 0, "reset": 0, "answered": 0, "stalled": 0}
        self.matched: list[tuple[float, str]] = []  # (monotonic time, request line) each targeted fault failed
        self.port = 0
        self._listener: socket.socket | None = self._listen()
        self.port = self._listener.getsockname()[1]
        self._start(self._accept_loop, self._listener)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kind(self) -> str | None:
        return self._kind

    # Commands.

    def fault(self, kind: str, only: str | None = None) -> None:
        """From now on, fail every connection as `kind` (one of KINDS); or only requests whose line `only` matches."""
        if kind not in KINDS or (only is not None and kind == "refuse"):
            raise ValueError(f"{kind!r} is not one of {KINDS} (refuse cannot be targeted)")
        with self._lock:
            self._kind, self._generation = kind, self._generation + 1
            self._only = re.compile(only.encode()) if only is not None else None
            listener = self._listener if kind == "refuse" else None
            if kind == "refuse":
                self._listener = None
        if listener is not None:
            listener.close()  # its accept loop ends; connects are refused until clear()

    def clear(self) -> None:
        """Forward again (the listener back on the same port after `refuse`)."""
        with self._lock:
            if self._kind == "refuse":
                self._listener = self._listen(self.port)
                self._start(self._accept_loop, self._listener)
            self._kind, self._only, self._generation = None, None, self._generation + 1

    @contextlib.contextmanager
    def during(self, kind: str, only: str | None = None) -> Iterator[None]:
        """`kind` (of the requests `only` matches, if given) inside the block, forwarding again after it."""
        self.fault(kind, only)
        try:
            yield
        finally:
            self.clear()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        for t in list(self._threads):
            t.join(timeout=5)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"fault proxy threads did not end: {alive}"

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]) -> None:
        self.close()

    # Machinery.

    def _listen(self, port: int = 0) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(64)
        s.settimeout(_POLL)
        return s

    def _start(self, target: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name=f"fault-proxy-{len(self._threads)}")
        self._threads = [x for x in self._threads if x.is_alive()]
        self._threads.append(t)
        t.start()

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._closed.is_set() and listener.fileno() != -1:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed: `refuse` or close()
                return
            conn.settimeout(None)
            with self._lock:
                self.counts["connections"] += 1
                self._start(self._serve, conn)

    def _serve(self, client: socket.socket) -> None:
        """One connection: forward, or fail it as the fault says, until either side closes."""
        upstream: socket.socket | None = None
        sent = 0  # bytes towards the server since the fault began (for `reset`)
        dropped = False  # a stall dropped bytes of this connection: it stays stalled
        generation, mine = self._generation, self._kind  # the fault this connection last saw
        only = self._only
        if only is not None:
            mine = None  # a targeted fault: request by request
        heads = _Heads()
        try:
            while not self._closed.is_set():
                kind = self._kind
                if generation != self._generation:
                    only = self._only
                    if kind in ("refuse", "slowdown", "internal") and only is None:
                        self._count("reset")
                        return  # the finally resets it
                    generation, sent = self._generation, 0
                    mine = "stall" if dropped else (None if only is not None else kind)
                if mine in ("slowdown", "internal"):
                    self._answer(client, mine)
                    return
                if mine == "refuse":
                    return
                if upstream is None and mine != "stall":
                    upstream = socket.create_connection(self._upstream, timeout=5)
                    upstream.settimeout(None)
                socks = [client] if upstream is None else [client, upstream]
                readable, _, _ = select.select(socks, [], [], _POLL)
                for s in readable:
                    data = s.recv(1 << 16)
                    if not data and mine == "stall" and s is upstream:
                        _reset(upstream)  # the server's side ended; the client's stays stalled
                        upstream = None
                        continue
                    if not data:
                        return
                    if mine == "stall":
                        self._count("stalled")
                        dropped = True
                        continue
                    if s is client:
                        assert upstream is not None
                        pieces, data = heads.split(data), b""
                        for i, (piece, line) in enumerate(pieces):
                            if line is None or only is None or kind is None or not only.search(line):
                                data += piece
                                continue
                            with self._lock:
                                self.matched.append((time.monotonic(), line.decode("latin-1")))
                            if kind == "reset":
                                self._count("reset")
                                return
                            if kind == "stall":  # this request and all after it on the connection
                                self._count("stalled")
                                dropped, mine = True, "stall"
                                break
                            upstream.sendall(data)  # what came before it
                            self._answer(client, kind, b"".join(p for p, _ in pieces[i:]))
                            return
                        if mine == "reset" and sent + len(data) > self.reset_after:
                            upstream.sendall(data[: max(0, self.reset_after - sent)])
                            self._count("reset")
                            return
                        sent += len(data)
                        upstream.sendall(data)
                    else:
                        client.sendall(data)
        except OSError:
            pass
        finally:
            _reset(client)
            if upstream is not None:
                _reset(upstream)

    def _answer(self, client: socket.socket, kind: str, buf: bytes = b"") -> None:
        """Reads one request's head (and its body, unless it waits for 100-continue), answers the error."""
        client.settimeout(5)
        while b"\r\n\r\n" not in buf:
            data = client.recv(1 << 16)
            if not data:
                return
            buf += data
        head, _, body = buf.partition(b"\r\n\r\n")
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])
        }
        if headers.get(b"expect", b"").lower() != b"100-continue":
            left = int(headers.get(b"content-length", b"0")) - len(body)
            while left > 0:
                data = client.recv(min(left, 1 << 16))
                if not data:
                    return
                left -= len(data)
        client.sendall(error_response(kind))
        self._count("answered")
        client.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):  # let the client read the answer before the reset
            client.recv(1)

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1


class _Heads:
    """Finds the requests in a connection's client-to-server bytes: heads, then Content-Length bodies.

    A head is held back until it is whole, so a targeted fault can fail it
    before the server sees any of it. A chunked body ends the following
    (every byte after it is forwarded as it comes).
    """

    def __init__(self) -> None:
        self._head = b""  # the start of a head not yet whole
        self._body_left = 0
        self._lost = False

    def split(self, data: bytes) -> list[tuple[bytes, bytes | None]]:
        """`data` in pieces to forward in order: (a whole head, its request line) or (other bytes, None)."""
        pieces: list[tuple[bytes, bytes | None]] = []
        while data:
            if self._lost:
                pieces.append((data, None))
                break
            if self._body_left:
                n = min(self._body_left, len(data))
                pieces.append((data[:n], None))
                data, self._body_left = data[n:], self._body_left - n
                continue
            self._head, data = self._head + data, b""
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                break  # held back until the rest of the head comes
            head, data, self._head = self._head[: end + 4], self._head[end + 4 :], b""
            lines = head[:end].split(b"\r\n")
            fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(b":") for x in lines[1:])}
            if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
                self._lost = True
            else:
                self._body_left = int(fields.get(b"content-length", b"0") or 0)
            pieces.append((head, lines[0]))
        return pieces
