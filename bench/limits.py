"""Section 4: what this machine allows: memcpy, fsync'd disk writes, gRPC on loopback.

Each is measured in the same run as the savers, so ratios against them hold
for this machine as it was at the time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.grpc_sink import METHOD, OPTIONS
from bench.stats import rates, summarize, timed

BLOCK = 8 << 20
CHUNK = 1 << 20  # RemotePolicySaver's default chunk_bytes


def memcpy(nbytes: int, reps: int) -> dict[str, Any]:
    """Copying `nbytes` of float32 into a buffer already touched (so no page faults).

    Small copies are repeated within one timing so the clock's resolution
    does not dominate; the time reported is per copy.
    """
    n = max(1, nbytes // 4)
    src = np.random.default_rng(0).random(n, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    inner = max(1, (64 << 20) // max(nbytes, 1))
    seconds = []
    for _ in range(max(reps, 5)):
        start = time.perf_counter()
        for _ in range(inner):
            np.copyto(dst, src)
        seconds.append((time.perf_counter() - start) / inner)
    return {"bytes": nbytes, "seconds": summarize(seconds), "bytes_per_second": rates(nbytes, seconds)}


def disk_fsync(directory: Path, nbytes: int, reps: int) -> dict[str, Any]:
    """Sequential writes of `nbytes` in 8 MiB blocks to a new file, then fsync; open to fsync."""
    directory.mkdir(parents=True, exist_ok=True)
    block = np.random.default_rng(1).bytes(BLOCK)
    seconds = []
    for i in range(reps):
        path = directory / f"disk-{i}.bin"

        def write() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # noqa: B023
            try:
                left = nbytes
                while left > 0:
                    left -= os.write(fd, block[: min(left, BLOCK)])
                os.fsync(fd)
            finally:
                os.close(fd)

        seconds.append(timed(write)[0])
        path.unlink()
    return {"bytes": nbytes, "seconds": summarize(seconds), "bytes_per_second": rates(nbytes, seconds)}


def grpc_loopback(workdir: Path, nbytes: int, reps: int) -> dict[str, Any]:
    """One client stream of `nbytes` in 1 MiB messages to a bare gRPC server in another process."""
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / "sink-port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.grpc_sink", "--port-file", str(port_file)],
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the gRPC sink did not start")
            time.sleep(0.02)  # polling a file for the port, with a deadline
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        chunk = np.random.default_rng(2).bytes(CHUNK)
        count = max(1, nbytes // CHUNK)
        sent = count * CHUNK
        with grpc.insecure_channel(address, options=OPTIONS) as channel:
            push = channel.stream_unary(METHOD)
            push(iter([b"warm"]), timeout=30, wait_for_ready=True)
            seconds = []
            for _ in range(reps):
                elapsed, reply = timed(lambda: push((chunk for _ in range(count)), timeout=300))
                if int(reply) != sent:
                    raise RuntimeError(f"the sink received {reply!r} bytes of {sent}")
                seconds.append(elapsed)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {
        "bytes": sent,
        "chunk_bytes": CHUNK,
        "seconds": summarize(seconds),
        "bytes_per_second": rates(sent, seconds),
    }
