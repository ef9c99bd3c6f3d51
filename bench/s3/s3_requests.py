"""CPU per small S3 request: the store's `SignedRequests` beside the boto3 client, in one run.

`python -m bench.s3.s3_requests` starts a radosgw of its own (scripts/rgw.sh;
`--endpoint URL --bucket B` with the AWS_* variables set uses another
plain-HTTP S3 server instead) and makes `--requests` PutObjects of `--size`
bytes through each contender, one at a time, in `--rounds` interleaved
rounds (each contender first in turn). It reports the median of the rounds' CPU per request of this
process (time.process_time: every thread's user and system time; the
server's own CPU is not in it): `sent` over the network, and `no network`,
the same calls with the connection replaced by a canned 200, which is what
signing and preparing each request costs (SignedRequests only).

`--against REV` adds the module of `SignedRequests` as it was at git
revision REV (read with `git show` from the path it had then, loaded as a
module of its own) as a third contender, so a
change to the request path is measured against the code before it in the
same run. It drives private parts of SignedRequests (the exchange it
replaces) because it measures them; it is a diagnostic, not an API user.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench import rgw
from bench.rgw import ROOT

REGION = "us-east-1"

Put = Callable[[str, bytes], Any]  # PutObject of (key, body)


@contextlib.contextmanager
def _radosgw(directory: Path) -> Iterator[tuple[str, str]]:
    """A radosgw of this run's own, its AWS_* variables set in os.environ; (endpoint, bucket)."""
    with rgw.radosgw(directory) as (s3, why):
        if s3 is None:
            raise SystemExit(why)
        os.environ.update(s3.env)
        yield s3.endpoint, s3.bucket


def _module_at(revision: str, work: Path, current: type) -> Any:
    """The module defining `current` as it was at `revision`, loaded under a name of its own.

    Its path is the one the class is defined in now, followed back through
    git's rename detection to where it was at `revision`.
    """
    source_file = inspect.getsourcefile(current)
    assert source_file is not None
    path = _path_at(revision, Path(source_file).resolve().relative_to(ROOT).as_posix())
    source = _git("show", f"{revision}:{path}")
    copy = work / "signed_at_revision.py"
    copy.write_text(source)
    spec = importlib.util.spec_from_file_location("signed_at_revision", copy)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _path_at(revision: str, path: str) -> str:
    """Where the file at `path` in HEAD was at `revision`: its old name if it was moved since."""
    for line in _git("diff", "--name-status", "-M", revision, "HEAD").splitlines():
        status, *names = line.split("\t")
        if status.startswith("R") and names[1] == path:
            return names[0]
    return path


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _canned(signed: Any) -> Any:
    """A copy of `signed` whose every request is answered 200 without the network."""
    offline = type(signed).__new__(type(signed))
    offline.__dict__.update(signed.__dict__)
    offline._exchange = lambda method, path, body, headers: (200, {"etag": '"canned"'}, b"")
    return offline


def _contenders(endpoint: str, bucket: str, against: str | None, work: Path) -> dict[str, Put]:
    from checkpointd.storage.s3 import make_client, small_requests

    client = make_client(endpoint, REGION)
    signed = small_requests(client)
    if signed is client:
        raise SystemExit(f"{endpoint} gets no SignedRequests (a plain-HTTP endpoint does)")
    contenders: dict[str, Any] = {"boto3 client": client, "SignedRequests": signed}
    if against is not None:
        module = _module_at(against, work, type(signed))
        credentials = client._request_signer._credentials  # the client's own, as make_client passes them
        contenders[f"SignedRequests@{against}"] = module.SignedRequests(
            endpoint, REGION, credentials, client.meta.events
        )
    puts: dict[str, Put] = {}
    for name, sender in contenders.items():
        puts[f"{name}, sent"] = _put(sender, bucket)
        if sender is not client:
            puts[f"{name}, no network"] = _put(_canned(sender), bucket)
    return puts


def _put(sender: Any, bucket: str) -> Put:
    return lambda key, body: sender.put_object(Bucket=bucket, Key=key, Body=body)


def _cpu_per_request(put: Put, requests: int, body: bytes, round_: int) -> float:
    started = time.process_time()
    for n in range(requests):
        put(f"bench-s3-requests/{round_}/{n % 64}", body)
    return (time.process_time() - started) / requests


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.s3.s3_requests", description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", help="a plain-HTTP S3 endpoint (default: start a radosgw)")
    parser.add_argument("--bucket", help="the bucket at --endpoint")
    parser.add_argument("--requests", type=int, default=2000, help="PutObjects per contender and round")
    parser.add_argument("--size", type=int, default=1024, help="bytes per PutObject")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", metavar="REV", help="also the s3_signed.py of this git revision")
    args = parser.parse_args(argv)
    if (args.endpoint is None) != (args.bucket is None):
        parser.error("--endpoint and --bucket go together")
    body = os.urandom(args.size)
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-s3-requests-")))
        endpoint, bucket = (
            (args.endpoint, args.bucket) if args.endpoint else stack.enter_context(_radosgw(work / "rgw"))
        )
        puts = _contenders(endpoint, bucket, args.against, work)
        for put in puts.values():  # warm up: connections, imports, caches
            _cpu_per_request(put, 50, body, -1)
        seconds: dict[str, list[float]] = {name: [] for name in puts}
        order = list(puts)
        for round_ in range(args.rounds):
            for name in order[round_ % len(order) :] + order[: round_ % len(order)]:  # each goes first in turn
                seconds[name].append(_cpu_per_request(puts[name], args.requests, body, round_))
    print(
        f"{args.requests} PutObjects of {args.size} B per round, {args.rounds} rounds, CPU of this process per request:"
    )
    for name, values in seconds.items():
        low, high = min(values) * 1e3, max(values) * 1e3
        print(f"  {name:<40} {statistics.median(values) * 1e3:6.3f} ms  ({low:.3f}-{high:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
