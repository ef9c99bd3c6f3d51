"""OpenCalls: a call of the service is kept while its handler runs; the kept handler is made once per method."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from checkpointd.rpc.calls import OpenCalls

SERVICE = "checkpointd.v1.CheckpointService"


class _Details(grpc.HandlerCallDetails):
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def test_a_call_is_kept_while_it_runs_and_each_method_is_wrapped_once() -> None:
    calls = OpenCalls(SERVICE)
    seen: list[int] = []

    def save(requests: Iterator[Any], context: Any) -> Iterator[str]:
        seen.append(len(calls))
        yield "decision"
        seen.append(len(calls))

    handler = grpc.stream_stream_rpc_method_handler(save)
    first = calls.intercept_service(lambda _: handler, _Details(f"/{SERVICE}/Save"))
    second = calls.intercept_service(lambda _: handler, _Details(f"/{SERVICE}/Save"))
    assert first is second and first is not handler  # made once, for every call of the method

    assert first is not None and first.stream_stream is not None
    assert list(first.stream_stream(iter(()), object())) == ["decision"]
    assert seen == [1, 1] and len(calls) == 0  # kept while it ran, let go at its end

    other = grpc.stream_stream_rpc_method_handler(save)  # the service's handler replaced: wrapped anew
    assert calls.intercept_service(lambda _: other, _Details(f"/{SERVICE}/Save")) is not first
    health = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    assert calls.intercept_service(lambda _: health, _Details("/grpc.health.v1.Health/Check")) is health
