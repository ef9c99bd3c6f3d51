"""The one error table (domain error <-> gRPC code) and the decorator that applies it."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator

import grpc
import pytest

from checkpointd.protocol import errors
from checkpointd.protocol.codes import CODES, code_for, error_for
from checkpointd.rpc.errors import grpc_errors


def domain_errors() -> list[type[errors.CheckpointdError]]:
    """Every CheckpointdError subclass, found in core/errors.py rather than listed."""
    found = [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.CheckpointdError) and cls is not errors.CheckpointdError
    ]
    pending = list(errors.CheckpointdError.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__ == errors.__name__ and cls not in found:
            found.append(cls)
    return found


def test_the_error_module_has_the_expected_number_of_errors() -> None:
    # Guards the discovery itself: an empty list would make the tests below vacuous.
    assert len(domain_errors()) >= 9


@pytest.mark.parametrize("cls", domain_errors(), ids=lambda c: c.__name__)
def test_every_domain_error_has_a_code(cls: type[errors.CheckpointdError]) -> None:
    assert cls in CODES
    assert code_for(cls("x")) is CODES[cls]


def test_the_table_is_one_to_one() -> None:
    assert len(set(CODES.values())) == len(CODES)
    assert grpc.StatusCode.OK not in CODES.values()


@pytest.mark.parametrize("cls", domain_errors(), ids=lambda c: c.__name__)
def test_error_for_code_for_round_trips_the_class(cls: type[errors.CheckpointdError]) -> None:
    back = error_for(code_for(cls("detail text")), "detail text")

    assert type(back) is cls
    assert str(back) == "detail text"


def test_codes_follow_the_retry_rules() -> None:
    assert CODES[errors.UnavailableError] is grpc.StatusCode.UNAVAILABLE
    assert CODES[errors.RunClosedError] is grpc.StatusCode.FAILED_PRECONDITION
    assert CODES[errors.InvalidRequestError] is grpc.StatusCode.INVALID_ARGUMENT


def test_a_subclass_outside_the_table_takes_its_base_code() -> None:
    class NarrowError(errors.RunNotFoundError):
        pass

    assert code_for(NarrowError("x")) is grpc.StatusCode.NOT_FOUND


def test_codes_outside_the_table_become_save_failed() -> None:
    error = error_for(grpc.StatusCode.CANCELLED, "")
    assert isinstance(error, errors.SaveFailedError)
    assert "CANCELLED" in str(error)


# --- the decorator ------------------------------------------------------------------------


class Aborted(Exception):
    """What a real ServicerContext.abort raises (a bare Exception) to end the RPC."""


class FakeContext:
    def __init__(self) -> None:
        self.aborts: list[tuple[grpc.StatusCode, str]] = []

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborts.append((code, details))
        raise Aborted(code, details)


class FakeRpcError(grpc.RpcError):
    pass


SECRET = "secret-token-/home/alice/.ssh"


class Servicer:
    @grpc_errors
    def Unary(self, request: object, context: FakeContext) -> str:
        if request == "domain":
            raise errors.RunNotFoundError("run 'r' is not registered")
        if request == "bug":
            raise KeyError(SECRET)
        if request == "cancelled":
            raise FakeRpcError()
        return "reply"

    @grpc_errors
    def Stream(self, request: object, context: FakeContext) -> Iterator[str]:
        yield "decision"
        if request == "domain":
            raise errors.UnavailableError("the daemon is shutting down")
        if request == "bug":
            raise ZeroDivisionError(SECRET)
        if request == "cancelled":
            raise FakeRpcError()
        yield "result"


def test_the_decorator_keeps_names_and_generator_nature() -> None:
    assert Servicer.Unary.__name__ == "Unary"
    assert Servicer.Stream.__name__ == "Stream"
    assert inspect.isgeneratorfunction(Servicer.Stream)
    assert not inspect.isgeneratorfunction(Servicer.Unary)


def test_unary_success_passes_through() -> None:
    context = FakeContext()
    assert Servicer().Unary("ok", context) == "reply"
    assert context.aborts == []


def test_unary_domain_error_aborts_with_its_code() -> None:
    context = FakeContext()

    with pytest.raises(Aborted):
        Servicer().Unary("domain", context)

    assert context.aborts == [(grpc.StatusCode.NOT_FOUND, "run 'r' is not registered")]


def test_stream_domain_error_aborts_with_its_code_after_earlier_messages() -> None:
    context = FakeContext()
    received: list[str] = []

    with pytest.raises(Aborted):
        for message in Servicer().Stream("domain", context):
            received.append(message)

    assert received == ["decision"]
    assert context.aborts == [(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down")]


def test_stream_success_passes_through() -> None:
    context = FakeContext()
    assert list(Servicer().Stream("ok", context)) == ["decision", "result"]
    assert context.aborts == []


@pytest.mark.parametrize(
    ("call", "exc_name"),
    [
        (lambda ctx: Servicer().Unary("bug", ctx), "KeyError"),
        (lambda ctx: list(Servicer().Stream("bug", ctx)), "ZeroDivisionError"),
    ],
    ids=["unary", "stream"],
)
def test_unexpected_error_is_internal_without_its_text(call, exc_name: str, caplog: pytest.LogCaptureFixture) -> None:
    context = FakeContext()

    with caplog.at_level(logging.ERROR, logger="checkpointd.rpc.errors"), pytest.raises(Aborted):
        call(context)

    assert len(context.aborts) == 1
    code, details = context.aborts[0]
    assert code is grpc.StatusCode.INTERNAL
    assert SECRET not in details
    assert "Traceback" not in details and ".py" not in details
    assert len(details) < 200
    # The full story goes to the log, once.
    records = [r for r in caplog.records if r.name == "checkpointd.rpc.errors"]
    assert len(records) == 1
    assert records[0].exc_info is not None
    assert type(records[0].exc_info[1]).__name__ == exc_name


@pytest.mark.parametrize(
    "call",
    [
        lambda ctx: Servicer().Unary("cancelled", ctx),
        lambda ctx: list(Servicer().Stream("cancelled", ctx)),
    ],
    ids=["unary", "stream"],
)
def test_rpc_error_of_an_ended_call_is_not_turned_into_a_status(call) -> None:
    context = FakeContext()

    with pytest.raises(FakeRpcError):
        call(context)

    assert context.aborts == []
