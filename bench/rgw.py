"""A Ceph radosgw of a bench tool's own (scripts/rgw.sh), stopped however the tool ends."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RGW_SCRIPT = ROOT / "scripts" / "rgw.sh"


@dataclass(frozen=True)
class S3:
    """A started radosgw: its endpoint, its bucket, and the AWS_* variables that reach it."""

    endpoint: str
    bucket: str
    env: dict[str, str]


@contextlib.contextmanager
def radosgw(directory: Path) -> Iterator[tuple[S3 | None, str]]:
    """Starts radosgw in `directory` (new or empty); (S3, "") or, if it cannot start, (None, why).

    It is stopped and `directory` removed when the block ends, however it ends.
    """
    proc = subprocess.run([str(RGW_SCRIPT), "start", str(directory)], capture_output=True, text=True, timeout=600)
    try:
        if proc.returncode != 0:
            yield None, f"radosgw did not start (scripts/rgw.sh exit {proc.returncode}): {proc.stderr.strip()}"
            return
        env = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
        aws = {k: v for k, v in env.items() if k.startswith("AWS_")}
        yield S3(env["CHECKPOINTD_TEST_S3_ENDPOINT"], env["CHECKPOINTD_TEST_S3_BUCKET"], aws), ""
    finally:
        subprocess.run([str(RGW_SCRIPT), "stop", str(directory)], timeout=120, check=False)
        shutil.rmtree(directory, ignore_errors=True)
