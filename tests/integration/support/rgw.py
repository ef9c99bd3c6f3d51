"""A real S3 server for the tests: Ceph's radosgw on loopback, through bench.rgw (scripts/rgw.sh).

The session fixture `rgw` starts it once, the first time a test asks for it
(so a run without S3 tests starts nothing), and stops it at the end of the
session, from a finalizer and from atexit (whichever comes first). If Ceph
cannot be installed (not root, or apt unreachable) the S3 tests skip with
that reason; any other failure to start fails them, with the logs.
"""

from __future__ import annotations

import atexit
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.rgw import Rgw, Unavailable, start

__all__ = ["Rgw", "rgw"]


@pytest.fixture(scope="session")
def rgw() -> Iterator[Rgw]:
    try:
        server = start(Path(tempfile.mkdtemp(prefix="checkpointd-rgw-")))
    except Unavailable as e:
        if e.cannot_install:
            pytest.skip(f"no S3 server for the S3 tests: {e}")
        pytest.fail(str(e))
    atexit.register(server.stop)  # also if the session is cut short
    print(f"\nradosgw started in {server.cold_start_seconds:.1f}s at {server.endpoint}", file=sys.stderr)
    try:
        yield server
    finally:
        server.stop()
