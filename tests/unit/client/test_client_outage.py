"""The client's pure rules: which save errors a trainer survives, the outage's backoff, the address check."""

from __future__ import annotations

import pytest

from checkpointd.protocol.address import AddressError, check_address, split_host_port, with_default_port
from checkpointd.protocol.errors import (
    ChecksumError,
    DeadlineError,
    InvalidRequestError,
    LimitExceededError,
    RunClosedError,
    RunHeldError,
    RunNotFoundError,
    SaveFailedError,
    UnauthenticatedError,
    UnavailableError,
)
from checkpointd_client.transport.connection import CONNECTION_OPTIONS, ConnectionOptions
from checkpointd_client.transport.outage import Outage, survivable
from tests.unit.conftest import FakeClock


@pytest.mark.parametrize(
    "error",
    [
        UnavailableError,
        DeadlineError,
        SaveFailedError,
        LimitExceededError,
        ChecksumError,
        RunHeldError,
        RunNotFoundError,
    ],
)
def test_what_the_daemons_state_causes_is_survived(error: type[Exception]) -> None:
    assert survivable(error("x"))


@pytest.mark.parametrize(
    "error", [InvalidRequestError, RunClosedError, UnauthenticatedError, ValueError, TypeError, KeyboardInterrupt]
)
def test_programming_errors_and_interrupts_are_not_survived(error: type[BaseException]) -> None:
    assert not survivable(error("x"))


def test_an_outage_begins_once_and_its_wait_doubles_up_to_the_most() -> None:
    clock = FakeClock(0.0)
    outage = Outage(clock, first=1.0, most=4.0)
    assert not outage.active and outage.retry_in() == 0.0
    assert outage.failed() is True  # began: the one warning
    assert outage.retry_in() == 1.0
    clock.advance(0.25)
    assert outage.retry_in() == 0.75
    outage.failed_fast()
    clock.advance(0.75)
    assert outage.retry_in() == 0.0  # the next save tries
    waits = []
    for _ in range(4):
        assert outage.failed() is False  # the same outage: no new warning
        waits.append(outage.retry_in())
        clock.advance(waits[-1])
    assert waits == [2.0, 4.0, 4.0, 4.0]
    assert outage.failures == 6


def test_an_answer_ends_the_outage_and_the_next_one_starts_from_the_first_wait() -> None:
    clock = FakeClock(10.0)
    outage = Outage(clock, first=1.0, most=30.0)
    assert outage.ended() is None  # no outage: nothing to report
    outage.failed()
    clock.advance(1.0)
    outage.failed()
    clock.advance(2.5)
    assert outage.ended() == 3.5
    assert not outage.active and outage.retry_in() == 0.0
    assert outage.failed() is True and outage.retry_in() == 1.0 and outage.failures == 1


@pytest.mark.parametrize(
    "url, host_port",
    [
        ("http://localhost:33100", "localhost:33100"),
        ("https://ckpt.example.com:7431/", "ckpt.example.com:7431"),
        ("grpc://10.0.0.5:7431", "10.0.0.5:7431"),
    ],
)
def test_a_url_is_refused_naming_the_host_port_to_give(url: str, host_port: str) -> None:
    with pytest.raises(AddressError, match="HOST:PORT, not a URL") as raised:
        check_address(url)
    assert repr(host_port) in str(raised.value)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize("address", ["localhost", "localhost:7431", "[::1]:7431", "dns:///ckpt:7431", "unix:/tmp/s"])
def test_addresses_grpc_dials_are_accepted(address: str) -> None:
    assert check_address(f" {address} ") == address


def test_an_empty_address_is_refused() -> None:
    with pytest.raises(AddressError, match="empty"):
        check_address("  ")


@pytest.mark.parametrize(
    "address, split",
    [("localhost:7431", ("localhost", 7431)), ("[::1]:9", ("::1", 9)), ("unix:/tmp/s", None), ("dns:///h:1", None)],
)
def test_a_dialled_tcp_address_splits_into_host_and_port(address: str, split: tuple[str, int] | None) -> None:
    assert split_host_port(with_default_port(address)) == split


def test_connection_options_are_checked_once_and_name_every_keyword() -> None:
    assert CONNECTION_OPTIONS == (
        "chunk_bytes", "channel_credentials", "timeout", "token", "token_file", "shared_memory",
    )  # fmt: skip
    with pytest.raises(ValueError, match="timeout"):
        ConnectionOptions(timeout=0)
    with pytest.raises(ValueError, match="not both"):
        ConnectionOptions(token="t", token_file="f")
    with pytest.raises(ValueError):
        ConnectionOptions(chunk_bytes=0)
    assert ConnectionOptions(token="t").read_token() == "t"
