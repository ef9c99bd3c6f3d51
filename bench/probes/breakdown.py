"""Where a checkpointd save's time goes, step by step, for one policy size.

`python -m bench.probes.breakdown --size large` times, on the real policy, each step
of the save path in isolation, then whole saves against a real daemon with
the daemon's own phase timings:

- trainer: the host copy (`tf.Variable.numpy()`, what the snapshot does),
  against a plain memcpy and a copy into freshly allocated memory; chunking
  as the client sends it (`wire.save_request_chunks`: CRC32C and serialized
  SaveRequests), and as Chunk messages;
- daemon-side steps, run here with the same libraries: parsing the
  requests, `upload.receive_snapshot` writing each checked chunk into the
  tensor bundle where it goes (`bundle.sink.BundleSink`, the daemon's
  streamed write) into the page cache, then with fsync, without and with
  the format's writeback (`durable.Writeback`), alternated;
- end to end: stall, call -> durable, and the daemon's transfer and write,
  over gRPC (`--transport grpc`, the default: shared memory off, as for a
  trainer on another host) or through shared memory (`--transport shm`).

`--py-spy DIR` also records the daemon and this process with py-spy (if it
is on PATH or in .venv-tools) during the end-to-end saves, as flame graphs
and top-style text under DIR: where each side's time goes, per function.

It reads two private pieces of the client (`_bindings`, `take_snapshot`)
because it measures them; it is a diagnostic, not an API user.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _time(label: str, fn: Callable[[], Any], reps: int, out: dict[str, float]) -> Any:
    seconds, result = [], None
    for _ in range(reps):
        result = None  # free the previous result first: each rep allocates as a save would
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    out[label] = statistics.median(seconds)
    print(f"  {label:58s} {out[label] * 1e3:9.1f} ms", flush=True)
    return result


def _py_spy() -> str | None:
    """The py-spy executable: on PATH, or in the repo's .venv-tools."""
    tools = Path(__file__).resolve().parents[2] / ".venv-tools" / "bin" / "py-spy"
    return shutil.which("py-spy") or (str(tools) if tools.exists() else None)


def _record(pid: int, out: Path) -> subprocess.Popen:
    """py-spy recording `pid` (all threads, without pausing it) as raw collapsed stacks at `out`."""
    exe = _py_spy()
    if exe is None:
        raise RuntimeError("--py-spy needs py-spy: pip install py-spy into .venv-tools")
    cmd = [exe, "record", "--pid", str(pid), "--nonblocking", "--threads", "--rate", "250"]
    return subprocess.Popen([*cmd, "--format", "raw", "--output", str(out)], stdout=subprocess.DEVNULL)


def _summarize(raw: Path, top: int = 25) -> str:
    """The functions holding the most samples (self and total) in a py-spy raw file."""
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        samples += n
        frames = stack.split(";")[1:]  # the first frame names the thread
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + n
        if frames:
            own[frames[-1]] = own.get(frames[-1], 0) + n
    lines = [f"{raw.name}: {samples} samples (all threads)", "  self%  total%  function"]
    for frame, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {100 * n / samples:5.1f}  {100 * total[frame] / samples:6.1f}  {frame}")
    return "\n".join(lines)


def run(
    size_name: str, reps: int, workdir: Path, transport: str = "grpc", py_spy: Path | None = None
) -> dict[str, Any]:
    import crc32c
    import numpy as np

    from bench import agents, scrape
    from bench.config import SIZES
    from bench.inprocess import fsync_tree
    from checkpointd import bundle, durable
    from checkpointd.bundle.sink import BundleSink
    from checkpointd.core.ports import Staged
    from checkpointd.protocol import wire
    from checkpointd.rpc import upload
    from checkpointd.v1 import checkpointd_pb2 as pb
    from checkpointd_client import RemotePolicySaver
    from checkpointd_client import snapshot as snapshots
    from tests.integration.support.daemon import start_daemon

    size = SIZES[size_name]
    daemon = start_daemon(workdir / "root", workdir / "work")
    steps: dict[str, float] = {}
    try:
        agent = agents.build_agent(size)
        saver = RemotePolicySaver(
            agent.policy,
            daemon.address,
            run="breakdown",
            train_step=agent.train_step_counter,
            timeout=600,
            shared_memory=transport == "shm",
        )
        saver.save("registered", blocking=True)
        bindings = saver._bindings  # noqa: SLF001 - the bindings the saver snapshots (set by its 1st save)
        assert bindings is not None
        variables = [b.variable for b in bindings.variables]
        nbytes = sum(v.dtype.size * int(v.shape.num_elements()) for v in variables)
        print(f"{size.name}: {size.params:,} parameters, {nbytes:,} bytes per snapshot")

        # The F821 waivers below: ruff takes the later `del`s (which free each phase's
        # memory) to unbind these names for the closures; each closure runs inside
        # _time, before its del.
        print("trainer side")
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        _time("memcpy into memory already touched", lambda: np.copyto(dst, src), reps, steps)  # noqa: F821
        _time("copy into fresh memory (np.copy)", src.copy, reps, steps)
        del src, dst
        _time("tf.Variable.numpy(), every variable", lambda: [v.numpy() for v in variables], reps, steps)
        snap = _time(
            "take_snapshot (the stall's copy)",
            lambda: snapshots.take_snapshot(bindings, agent.train_step_counter),
            reps,
            steps,
        )
        views = [memoryview(a.reshape(-1).view(np.uint8)) for a in snap.arrays]
        step = wire.CHUNK_BYTES
        print(f"  (chunks of {step:,} bytes)")
        _time(
            "CRC32C of every chunk's slice",
            lambda: [crc32c.crc32c(v[i : i + step]) for v in views for i in range(0, len(v), step)],  # noqa: F821
            reps,
            steps,
        )
        encoded = _time(
            "wire.save_request_chunks: what the client sends",
            lambda: list(wire.save_request_chunks(snap.parts(), step)),  # noqa: F821
            reps,
            steps,
        )
        chunks = _time(
            "wire.chunks: bytes copies + CRC32C + Chunk",
            lambda: list(wire.chunks(snap.parts(), step)),  # noqa: F821
            reps,
            steps,
        )
        _time(
            "SaveRequest(chunk).SerializeToString(), all chunks",
            lambda: [pb.SaveRequest(chunk=c).SerializeToString() for c in chunks],  # noqa: F821
            reps,
            steps,
        )

        print("daemon-side steps, in this process")
        requests = _time(
            "SaveRequest.FromString, every request (gRPC's parse)",
            lambda: [pb.SaveRequest.FromString(e) for e in encoded],  # noqa: F821
            reps,
            steps,
        )
        del encoded
        parts = [a.nbytes for a in snap.arrays]
        entries = [bundle.Entry(f"v{i}", a.dtype.name, tuple(a.shape), a.nbytes) for i, a in enumerate(snap.arrays)]
        out = workdir / "bundle"

        def streamed(writeback: bool = False) -> None:
            """The daemon's streamed write: each chunk checked, then pwritten into the bundle where it goes."""
            shutil.rmtree(out, ignore_errors=True)
            (out / "variables").mkdir(parents=True)
            with durable.Writeback(out / "variables") if writeback else contextlib.nullcontext():
                with BundleSink(
                    out / "variables" / "variables",
                    entries,
                    list(range(len(parts))),
                    parts,
                    lambda i, t: Staged(out, 0, {}),
                ) as sink:
                    upload.receive_snapshot(iter(requests), nbytes, _Active(), parts, None, sink)  # noqa: F821
                    sink.finish()

        _time("receive_snapshot into the bundle: checks, CRC32C, pwrite", streamed, reps, steps)

        def streamed_fsync(writeback: bool) -> None:
            streamed(writeback)
            fsync_tree(out)

        # The two alternate, so that both see the machine in the same state.
        labels = {
            False: "streamed bundle write, then fsync",
            True: "streamed bundle write, durable.Writeback, then fsync",
        }
        seconds: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(reps):
            for writeback in (False, True):
                start = time.perf_counter()
                streamed_fsync(writeback)
                seconds[writeback].append(time.perf_counter() - start)
        for writeback, label in labels.items():
            steps[label] = statistics.median(seconds[writeback])
            print(f"  {label:58s} {steps[label] * 1e3:9.1f} ms", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        del requests, chunks, snap, views

        print(f"end to end, against the daemon (transport: {transport})")
        spies = []
        if py_spy is not None:
            py_spy.mkdir(parents=True, exist_ok=True)
            spies = [_record(daemon.proc.pid, py_spy / "daemon.txt"), _record(os.getpid(), py_spy / "client.txt")]
            time.sleep(1.0)  # py-spy attaches in the background; a save before it would go unseen
        before = scrape.phase_totals(daemon.metrics_url)
        stall, latency = [], []
        for i in range(reps):
            start = time.perf_counter()
            ticket = saver.save(f"s{i}")
            stall.append(time.perf_counter() - start)
            ticket.result(600)
            latency.append(time.perf_counter() - start)
            shutil.rmtree(daemon.root / "breakdown" / f"s{i}", ignore_errors=True)
        steps["save(): stall"] = statistics.median(stall)
        steps["save(): call -> durable"] = statistics.median(latency)
        for key, mean in scrape.phase_means(before, scrape.phase_totals(daemon.metrics_url)).items():
            steps[f"daemon {key} (mean)"] = mean
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        if py_spy is not None:
            for name in ("daemon.txt", "client.txt"):
                if (py_spy / name).exists():
                    print(_summarize(py_spy / name))
        for key in [k for k in steps if k.startswith(("save():", "daemon "))]:
            print(f"  {key:58s} {steps[key] * 1e3:9.1f} ms")
        saver.close()
    finally:
        daemon.terminate()
    return {
        "size": size.name,
        "params": size.params,
        "bytes": nbytes,
        "transport": transport,
        "chunk_bytes": wire.CHUNK_BYTES,
        "median_seconds": steps,
    }


class _Active:
    """A call that never ends early: receive_snapshot's context, outside gRPC."""

    def is_active(self) -> bool:
        return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.probes.breakdown",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", default="large")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, help="also write the medians as JSON here")
    p.add_argument(
        "--transport",
        choices=("grpc", "shm"),
        default="grpc",
        help="how end-to-end saves travel: gRPC chunks (shared memory off, default) or shared memory",
    )
    p.add_argument("--py-spy", type=Path, help="record the daemon and this process with py-spy into this dir")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="checkpointd-breakdown-"))
    try:
        result = run(args.size, args.reps, workdir, args.transport, args.py_spy)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
