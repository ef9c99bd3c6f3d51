"""The service's open calls, so a daemon stopped at once can end each with a status that says so.

A second SIGTERM or SIGINT during the drain exits without waiting for the
saves in flight (`checkpointd.cli.serve`). Without a word, their callers
would see the connection drop ("Socket closed") and could not tell a
daemon stopped on purpose from a network fault. `OpenCalls`, a server
interceptor, keeps every open call of the CheckpointService; `end_all`
sends each its status (UNAVAILABLE and what happened) and waits, bounded,
until gRPC has handed the statuses to the transport.

grpc's public `ServicerContext.abort` ends a call only from the thread that
runs its handler (it raises there), and those threads are blocked in the
saves being abandoned. So `end_all` sends the status through grpcio's own
`_server._abort`, the function `abort` and grpcio's bad-request paths call:
private API of the pinned grpcio. If it is not there (another grpcio),
nothing is sent and the callers see the connection close.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

_LOGGER = logging.getLogger(__name__)
_POLL_SECONDS = 0.01  # how often end_all looks whether the statuses went out (bounded by its timeout)


@dataclass(frozen=True)
class _Call:
    method: str  # "/checkpointd.v1.CheckpointService/Save"
    context: grpc.ServicerContext


class OpenCalls(grpc.ServerInterceptor):
    """A server interceptor that keeps the open calls of one service. Thread-safe."""

    def __init__(self, service: str) -> None:
        """Args:
        service: the full service name whose calls it keeps
            (`checkpointd.v1.CheckpointService`); health and reflection are not kept.
        """
        self._prefix = f"/{service}/"
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count()
        # The kept handler of each method's handler, made once: gRPC's poller thread,
        # which every call's every message waits on, runs the interceptors for each call.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._calls)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefix):
            return handler
        made = self._wrapped.get(method)
        if made is None or made[0] is not handler:
            made = (handler, self._kept(handler, method))
            self._wrapped[method] = made  # a dict's item set is atomic; two threads making one is harmless
        return made[1]

    def end_all(self, code: grpc.StatusCode, details: Callable[[str], str], timeout: float) -> int:
        """Ends every open call now with `code` and `details(method name)`; returns how many it ended.

        Returns once gRPC has sent every status, or after `timeout` seconds.
        """
        with self._lock:
            calls = list(self._calls.values())
        sent = [token for call in calls if (token := _end(call.context, code, details(call.method.rpartition("/")[2])))]
        deadline = time.monotonic() + timeout
        while any(_pending(token) for token in sent) and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)  # grpc signals a sent status to no one outside its call: poll, bounded
        return len(sent)

    def _kept(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """A handler of the same shape as `handler` whose call is kept while its behaviour runs."""
        streaming = handler.response_streaming
        behavior: Callable[[Any, grpc.ServicerContext], Any] = {  # type: ignore[assignment]
            (False, False): handler.unary_unary,
            (False, True): handler.unary_stream,
            (True, False): handler.stream_unary,
            (True, True): handler.stream_stream,
        }[(handler.request_streaming, streaming)]

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            key = self._add(method, context)
            try:
                return behavior(request, context)
            finally:
                self._remove(key)

        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            key = self._add(method, context)
            try:
                yield from behavior(request, context)
            finally:
                self._remove(key)

        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, streaming)]
        return make(
            stream if streaming else unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _add(self, method: str, context: grpc.ServicerContext) -> int:
        with self._lock:
            key = next(self._ids)
            self._calls[key] = _Call(method, context)
            return key

    def _remove(self, key: int) -> None:
        with self._lock:
            self._calls.pop(key, None)


@dataclass(frozen=True)
class _Sent:
    state: Any  # grpc._server._RPCState
    token: str


def _end(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> _Sent | None:
    """Sends the call's status from outside its handler's thread; None if it had one or cannot be sent."""
    try:
        from grpc import _common, _server  # private: see the module docstring

        state = context._state  # type: ignore[attr-defined]  # noqa: SLF001
        call = context._rpc_event.call  # type: ignore[attr-defined]  # noqa: SLF001
        abort = _server._abort  # noqa: SLF001
        wire_code = _common.STATUS_CODE_TO_CYGRPC_STATUS_CODE[code]
    except (ImportError, AttributeError, KeyError) as e:
        _LOGGER.debug("cannot end a call from outside its handler with this grpcio: %s", e)
        return None
    try:
        with state.condition:
            if state.statused or state.client is _server._CANCELLED:  # noqa: SLF001
                return None
            state.code, state.details = code, _common.encode(details)  # what abort sends, whatever was set
            before = set(state.due)
            abort(state, call, wire_code, state.details)
            token = next(iter(set(state.due) - before), None)
    except Exception as e:  # noqa: BLE001 - the process is exiting: never fail its exit
        _LOGGER.debug("could not end a call: %s", e)
        return None
    return _Sent(state, token) if token is not None else None


def _pending(sent: _Sent) -> bool:
    with sent.state.condition:
        return sent.token in sent.state.due
