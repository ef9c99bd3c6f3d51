"""writes.streamed ended early: a write failure is said once and raised as SaveFailedError; the broken
stream of a caller that went away is raised as it is, unlogged (the pipeline logs the save once, as cancelled)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from checkpointd.core.ports import SaveMeta
from checkpointd.core.variable_manifest import Manifest
from checkpointd.protocol.errors import SaveFailedError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.saves import writes
from tests.component.conftest import VARIABLES
from tests.component.fakes import FakeFormat, FakeStore


class _BrokenStream(Exception):
    """What gRPC's request iterator raises once the caller cancelled (a grpc.RpcError: this layer imports no gRPC)."""


def _end_early(tmp_path: Path, *, gone: bool) -> FakeStore:
    store = FakeStore(tmp_path / "staging")
    manifest = Manifest(VARIABLES)
    meta = SaveMeta("run1", SaveKind.SAVED_MODEL, 1, "p")
    parts = [v.nbytes for v in VARIABLES] + [0]
    with writes.streamed(
        store, FakeFormat(store.files), meta, manifest, store.target("run1", "p"), parts, None, gone=lambda: gone
    ):
        raise _BrokenStream("the request stream broke")
    return store  # not reached


def test_the_broken_stream_of_a_caller_gone_is_raised_as_it_is_and_not_said_to_be_a_write_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="checkpointd.saves.writes"):
        with pytest.raises(_BrokenStream):
            _end_early(tmp_path, gone=True)
    assert caplog.records == []
    assert not list((tmp_path / "staging").iterdir())  # its staging was discarded all the same


def test_the_same_error_while_the_caller_is_there_is_a_write_failure_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="checkpointd.saves.writes"):
        with pytest.raises(SaveFailedError, match="the request stream broke"):
            _end_early(tmp_path, gone=False)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert not list((tmp_path / "staging").iterdir())
