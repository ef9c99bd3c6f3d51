"""The fleet section's helper processes: the template maker (TensorFlow) and the simulated trainers (none).

`python -m bench.fleet template DIR` (`make_template`) exports the small
policy (bench.agents, 4.6k parameters) once with the real PolicySaver and
writes what a trainer sends: the template files, the RegisterRunHeader
(variables, object graph, template size) and the snapshot's payload bytes.

`python -m bench.fleet clients ...` (`run_clients`: a client process, 64
trainers in the section, on grpc.aio, no TensorFlow) speaks the contract
directly, as tests/integration/support/raw.py does:

- every trainer registers its own run (`fleet-<i>`) with those bytes and
  says so; when all have, the section writes a start time on each
  process's stdin;
- trainer i starts at that time plus i/N of a period (phase-spread) and
  then, once a period, makes a non-blocking save: a Save call (header,
  decision; if accepted, the payload's chunks and a half-close, then the
  result), not waiting for the previous one (skip-if-busy skips a save
  while the run's last is still in flight, as a trainer's `save()` would);
- per save it records accepted, skipped or failed (the gRPC status: a
  RESOURCE_EXHAUSTED at the daemon's --max-concurrent-uploads counts
  here) and call -> durable (the SaveResult's arrival);
- at the end, a Flush per run, and one JSON line of outcomes, with the
  process's own CPU over the window (its rusage) and whether TensorFlow
  was imported (`sys.modules`).
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

RATE_HZ = 1.0
TIMEOUT = 60.0  # every RPC's deadline


def make_template(directory: Path) -> None:
    """Exports the small policy once; writes its files, the RegisterRunHeader and the payload under `directory`."""
    import tensorflow as tf
    from tf_agents.policies import policy_saver

    from bench import agents
    from bench.config import SIZES
    from checkpointd.protocol import wire
    from checkpointd.v1 import checkpointd_pb2 as pb
    from checkpointd_client import snapshot as client_snapshot

    agent = agents.build_agent(SIZES["small"])
    train_step = tf.Variable(0, dtype=tf.int64)
    saver = policy_saver.PolicySaver(agent.policy, train_step=train_step)
    files = directory / "files"
    saver.save(str(files))
    bindings = client_snapshot.bind(saver, str(files))
    snap = client_snapshot.take_snapshot(bindings, train_step)
    payload = b"".join(bytes(p) for p in snap.parts())
    header = pb.RegisterRunHeader(
        variables=bindings.protos(), checkpoint_object_graph=bindings.object_graph,
        template_bytes=wire.template_size(files),
    )  # fmt: skip
    (directory / "header.bin").write_bytes(header.SerializeToString())
    (directory / "payload.bin").write_bytes(payload)
    spec = {"template_bytes": header.template_bytes, "snapshot_bytes": len(payload)}
    (directory / "spec.json").write_text(json.dumps(spec))


async def run_clients(addresses: list[str], spec: Path, first: int, count: int, trainers: int, seconds: float) -> None:
    """A client process: `count` simulated trainers from `first` on, no TensorFlow; its JSON lines on stdout.

    Args:
        addresses: the daemons; trainer i uses addresses[i % len(addresses)].
        spec: the directory `make_template` wrote.
        first: the first trainer's index (its run is `fleet-<first>`).
        count: this process's trainers.
        trainers: the whole fleet's, for the phase spread.
        seconds: the saving window, from the start time read on stdin.
    """
    import grpc

    from checkpointd.protocol import wire
    from checkpointd.v1 import checkpointd_pb2 as pb
    from checkpointd.v1 import checkpointd_pb2_grpc

    base = pb.RegisterRunHeader.FromString((spec / "header.bin").read_bytes())
    payload = (spec / "payload.bin").read_bytes()
    # The client library's chunk size, as a trainer's saver sends.
    template_chunks = list(wire.template_chunks(spec / "files", wire.CHUNK_BYTES))
    chunks = [pb.SaveRequest(chunk=c) for c in wire.chunks([payload], wire.CHUNK_BYTES)]
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [checkpointd_pb2_grpc.CheckpointServiceStub(c) for c in channels]
    runs = [(f"fleet-{i}", i) for i in range(first, first + count)]

    async def register(run: str, i: int) -> None:
        header = pb.RegisterRunHeader()
        header.CopyFrom(base)
        header.run = run
        requests = [pb.RegisterRunRequest(header=header), *(pb.RegisterRunRequest(chunk=c) for c in template_chunks)]
        reply = await stubs[i % len(stubs)].RegisterRun(iter(requests), timeout=TIMEOUT)
        if reply.snapshot_bytes != len(payload):
            raise RuntimeError(
                f"{run}: the daemon expects {reply.snapshot_bytes} bytes, the payload has {len(payload)}"
            )

    for k in range(0, count, 16):  # 16 registrations at a time
        await asyncio.gather(*(register(r, i) for r, i in runs[k : k + 16]))
    print(json.dumps({"ready": count}), flush=True)
    start = float(await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline))
    cpu0 = _own_cpu_seconds()

    out: dict[str, Any] = {"offered": 0, "accepted": 0, "skipped": 0, "failed": 0, "committed": 0, "flush_failed": 0}
    latencies: list[float] = []
    lags: list[float] = []
    failures: list[str] = []
    codes: dict[str, int] = {}  # "refused: CODE" or "after accept: CODE" -> calls
    examples: dict[str, str] = {}  # the first message of each
    period = 1.0 / RATE_HZ

    async def save(stub: Any, run: str, n: int) -> None:
        header = pb.SaveRequest(
            header=pb.SaveHeader(
                run=run, kind=pb.SAVED_MODEL, export_dir=f"s{n}", step=n,
                variables=base.variables, snapshot_bytes=len(payload),
            )
        )  # fmt: skip
        began = time.perf_counter()
        call = stub.Save(timeout=TIMEOUT)
        accepted = False
        try:
            await call.write(header)
            first_reply = await call.read()
            if not first_reply.decision.accepted:
                out["skipped"] += 1
                await call.done_writing()
                return
            accepted = True
            out["accepted"] += 1
            for c in chunks:
                await call.write(c)
            await call.done_writing()
            reply = await call.read()
            if reply.WhichOneof("item") != "result":
                raise RuntimeError(f"no SaveResult: {reply}")
            latencies.append(time.perf_counter() - began)
            out["committed"] += 1
        except grpc.aio.AioRpcError as e:
            # Before the decision the daemon refused the call (nothing written or
            # counted); after an accept the save failed and the client knows it.
            out["failed"] += 1
            key = f"{'after accept' if accepted else 'refused'}: {e.code().name}"
            codes[key] = codes.get(key, 0) + 1
            examples.setdefault(key, f"{run} s{n}: {e.details()}")

    async def trainer(run: str, i: int) -> None:
        stub = stubs[i % len(stubs)]
        t0 = start + period * i / trainers
        tasks = []
        n = 0
        while (due := t0 + n * period) < start + seconds:
            await asyncio.sleep(max(0.0, due - time.time()))
            lags.append(time.time() - due)
            out["offered"] += 1
            tasks.append(asyncio.create_task(save(stub, run, n)))
            n += 1
        await asyncio.gather(*tasks)
        try:
            await stub.Flush(pb.FlushRequest(run=run, timeout_seconds=TIMEOUT), timeout=TIMEOUT + 5)
        except grpc.aio.AioRpcError as e:
            out["flush_failed"] += 1
            failures.append(f"{run} flush: {e.code().name}: {e.details()}")

    await asyncio.gather(*(trainer(r, i) for r, i in runs))
    cpu = _own_cpu_seconds() - cpu0
    for c in channels:
        await c.close()
    out |= {
        "cpu_seconds": cpu,
        "latencies": latencies,
        "lags": lags,
        "failures": failures[:5],
        "codes": codes,
        "examples": examples,
        "tensorflow_imported": "tensorflow" in sys.modules,
    }
    print(json.dumps(out), flush=True)


def _own_cpu_seconds() -> float:
    """This process's CPU seconds, every thread (gRPC's own included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
