"""Multi-step scenarios: what the harness sends after seeing the daemon's first answer, and how it checks it.

Each driver takes the `Fuzzer` (fuzz_harness.py) and one `Scenario`, and
judges every call it makes through `Fuzzer.judge`: a held lane with a
second request (overlap), a cancel mid-upload, an incremental save against
the base its accept offers, a shared-memory save into the offered segment,
a save decided under the run's busy lock (HeldSave), and the reads whose
answers are checked byte for byte (Restore, RestoreFiles sent and staged).
`SEQUENCES` maps each `Scenario.rpc` handled here to its driver.
"""

from __future__ import annotations

import fcntl
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import crc32c
import grpc
import numpy as np

from checkpointd.v1 import checkpointd_pb2 as pb
from tests.integration.support.daemon import wait_until
from tests.integration.support.fuzz.fuzz_harness import RPC_TIMEOUT, Fuzzer, Outcome, good_header, hold
from tests.integration.support.fuzz.fuzz_incremental import BIG_CHUNK, BIG_PAYLOAD
from tests.integration.support.fuzz.fuzz_world import (
    BIG_TRAINING,
    MAIN,
    MAIN_FOLDER,
    MAIN_FOLDERED,
    Code,
    Scenario,
    collides,
    crc_chunk,
    normalized,
)
from tests.integration.support.raw import RawSave, run_status

FOLDERS = {MAIN: MAIN, MAIN_FOLDERED: MAIN_FOLDER, BIG_TRAINING: BIG_TRAINING}


# --- A held lane, and a cancel ---


def _held(fuzzer: Fuzzer, export_dir: str) -> tuple[RawSave, pb.SaveHeader]:
    """A save of the main run, accepted and then silent: the run's lane is busy."""
    header = good_header(fuzzer.world, MAIN, export_dir)
    return hold(fuzzer.stub, header), header


def _end_held(fuzzer: Fuzzer, scenario: Scenario, call: RawSave, header: pb.SaveHeader, ending: str) -> None:
    chunks = list(fuzzer.world.good_chunks)
    if ending == "bad-crc":
        broken = chunks[1]
        chunks[1] = pb.Chunk(offset=broken.offset, data=broken.data, crc32c=broken.crc32c ^ 1)
    elif ending == "truncate":
        chunks = chunks[:-1]
    call.send_chunks(chunks)
    if ending == "cancel":
        call.cancel()
        fuzzer.cancelled()
        return
    call.half_close()
    started = time.monotonic()
    accepted = pb.SaveDecision(accepted=True)
    try:
        result = call.result()
        outcome = Outcome(Code.OK, "", accepted, result, time.monotonic() - started)
    except grpc.RpcError as e:
        outcome = Outcome(e.code(), e.details() or "", accepted, None, time.monotonic() - started)
    held = Scenario(scenario.category + "/held", "Save", [pb.SaveRequest(header=header)])
    held.exact = {"good": Code.OK, "bad-crc": Code.DATA_LOSS, "truncate": Code.INVALID_ARGUMENT}[ending]
    if held.exact is Code.OK:
        held.expect_ok_path = str(fuzzer.world.root / MAIN / header.export_dir)
    fuzzer.judge(held, outcome)


def overlap(fuzzer: Fuzzer, scenario: Scenario) -> None:
    second, ending, timeout, export_dir = scenario.payload
    call, header = _held(fuzzer, export_dir)
    try:
        probe = Scenario(scenario.category, "Save", [])
        if second in ("skip", "checkpoint-skip", "blocking-deadline"):
            h = good_header(fuzzer.world, MAIN, "p2")
            h.kind = pb.CHECKPOINT if second == "checkpoint-skip" else pb.SAVED_MODEL
            h.blocking = second == "blocking-deadline"
            chunks = [pb.SaveRequest(chunk=c) for c in fuzzer.world.good_chunks]
            probe.payload = [pb.SaveRequest(header=h), *chunks]
            if second == "blocking-deadline":
                # Waits behind the held save until its own deadline passes.
                started = time.monotonic()
                try:
                    list(fuzzer.stub.Save(iter(probe.payload), timeout=0.3))
                    outcome = Outcome(Code.OK)
                except grpc.RpcError as e:
                    outcome = Outcome(e.code(), e.details() or "")
                outcome.seconds = time.monotonic() - started
                probe.exact = Code.DEADLINE_EXCEEDED
                # The client's deadline can fire before the daemon withdraws
                # the waiter; ending the held save first would start it.
                wait_until(
                    lambda: run_status(fuzzer.stub, MAIN).in_flight.waiting == 0,
                    "the blocking save gave up its place",
                    RPC_TIMEOUT,
                )
            else:
                outcome = fuzzer.save(probe.payload)
                probe.exact = Code.OK
                assert outcome.decision is not None and not outcome.decision.accepted, outcome
            fuzzer.judge(probe, outcome)
        elif second in ("flush-run", "flush-all"):
            probe.rpc = "Flush"
            run = MAIN if second == "flush-run" else ""
            probe.payload = pb.FlushRequest(run=run, timeout_seconds=timeout)
            outcome = fuzzer.unary(fuzzer.stub.Flush, probe.payload)
            probe.exact = Code.DEADLINE_EXCEEDED
            fuzzer.judge(probe, outcome)
        else:
            probe.rpc = "GetStatus"
            assert run_status(fuzzer.stub, MAIN).in_flight.export_dir == export_dir
            fuzzer.judge(probe, Outcome(Code.OK))
    finally:
        _end_held(fuzzer, scenario, call, header, ending)


def cancel_mid_upload(fuzzer: Fuzzer, scenario: Scenario) -> None:
    call, _ = _held(fuzzer, "p1")
    call.send_chunks(fuzzer.world.good_chunks[:2])
    call.cancel()
    fuzzer.cancelled()


# --- Saves that follow their accept: incremental, shared memory, held ---


def _send_after_accept(call: RawSave, requests: Sequence[pb.SaveRequest], started: float) -> Outcome:
    """Sends the rest of an accepted save, half-closes and reads how it ended."""
    accepted = pb.SaveDecision(accepted=True)
    call.send(*requests)
    call.half_close()
    try:
        result = call.result()
        return Outcome(Code.OK, "", accepted, result, time.monotonic() - started)
    except grpc.RpcError as e:
        return Outcome(e.code(), e.details() or "", accepted, None, time.monotonic() - started)


def _open(fuzzer: Fuzzer, header: pb.SaveHeader) -> tuple[RawSave, pb.SaveDecision | Outcome, float]:
    """Opens a Save with `header`; its decision, or the Outcome of a call refused before one."""
    started = time.monotonic()
    call = RawSave(fuzzer.stub, pb.SaveRequest(header=header))
    try:
        return call, call.decision(), started
    except grpc.RpcError as e:
        return call, Outcome(e.code(), e.details() or "", None, None, time.monotonic() - started), started


def _judge_save(fuzzer: Fuzzer, category: str, header: pb.SaveHeader, outcome: Outcome, exact: Code | None) -> None:
    scenario = Scenario(category, "Save", [pb.SaveRequest(header=header)], exact=exact)
    folder = FOLDERS[header.run]
    export_dir = (
        f"{header.export_dir}/ckpt-{header.step}" if header.HasField("training_checkpoint") else header.export_dir
    )
    if collides(fuzzer.world.root, folder, export_dir):
        scenario.exact = None if exact is Code.OK else exact
        scenario.internal = "publishing onto a non-directory: SaveFailedError, INTERNAL by the table"
    elif scenario.exact is Code.OK:
        scenario.expect_ok_path = str(fuzzer.world.root / folder / normalized(export_dir))
    fuzzer.judge(scenario, outcome)


def _payload_chunks(payload: bytes, size: int, start: int = 0) -> list[pb.SaveRequest]:
    return [pb.SaveRequest(chunk=crc_chunk(payload[i : i + size], i)) for i in range(start, len(payload), size)]


def _incremental_requests(plan: str, payload: bytes, base: bool) -> tuple[list[pb.SaveRequest], Code | None]:
    """What follows the accept of an incremental save, by plan, and the code it must get."""
    total, crc = len(payload), crc32c.crc32c(payload)  # BIG_PAYLOAD is one chunk: one digest
    cut = min(BIG_CHUNK, total // 2)  # where chunk-then-same switches

    def same(offset: int, length: int, crcs: Sequence[int] = (crc,)) -> pb.SaveRequest:
        return pb.SaveRequest(same=pb.SameChunks(offset=offset, length=length, chunk_crc32c=crcs))

    if plan == "chunks":
        return _payload_chunks(payload, BIG_CHUNK), Code.OK
    plans = {
        "same-all": [same(0, total)],
        "same-bad-crc": [same(0, total, [crc ^ 1])],
        "same-offset": [same(1, total - 1)],
        "same-past-end": [same(0, total + 1)],
        "same-twice": [same(0, total), same(0, total)],
        "same-then-chunk": [same(0, total), pb.SaveRequest(chunk=crc_chunk(b"x", total))],
        "same-no-crc": [same(0, total, [])],
        "chunk-then-same": [*_payload_chunks(payload[:cut], cut), same(cut, total - cut)],
    }
    requests = plans[plan]
    if not base:  # SameChunks without a base offered
        return requests, Code.INVALID_ARGUMENT
    # With a base: only the whole payload as one range is whole chunks with their digests;
    # a range without digests is left open (the daemon checks what it copied at the commit).
    return requests, {"same-all": Code.OK, "same-no-crc": None}.get(plan, Code.INVALID_ARGUMENT)


def incremental(fuzzer: Fuzzer, scenario: Scenario) -> None:
    header, plan = scenario.payload
    big = header.run == BIG_TRAINING
    payload = BIG_PAYLOAD if big else b"".join(c.data for c in fuzzer.world.good_chunks)
    call, decision, started = _open(fuzzer, header)
    try:
        if isinstance(decision, Outcome):
            _judge_save(fuzzer, scenario.category, header, decision, None)
            return
        assert decision.accepted, f"the lane was not idle: {decision.reason}"
        base = decision.HasField("base")
        assert big or not base, "a base offered for a save under one chunk"
        if base:
            # The tensor's one digest. (The daemon offers a second, empty part for a
            # one-tensor checkpoint, where the contract says one per payload part.)
            first, *rest = decision.base.parts
            assert decision.base.chunk_bytes == len(BIG_PAYLOAD), decision.base
            assert list(first.chunk_crc32c) == [crc32c.crc32c(BIG_PAYLOAD)], decision.base
            assert not any(p.chunk_crc32c for p in rest), decision.base
        requests, exact = _incremental_requests(plan, payload, base)
        if not big and plan == "chunks":
            requests = [pb.SaveRequest(chunk=c) for c in fuzzer.world.good_chunks]
        outcome = _send_after_accept(call, requests, started)
    finally:
        call.close()
    category = f"{scenario.category}/{'base' if base else 'no-base'}"
    _judge_save(fuzzer, category, header, outcome, exact)
    if outcome.code is Code.OK and base:
        fuzzer.based_saves += 1
    if outcome.code is Code.OK and plan == "same-all":
        assert outcome.result is not None
        assert (outcome.result.bytes_copied, outcome.result.bytes_received) == (len(payload), 0), outcome.result


def _parts(fuzzer: Fuzzer) -> list[bytes]:
    """The good snapshot cut at each variable (manifest order)."""
    payload, parts, start = b"".join(c.data for c in fuzzer.world.good_chunks), [], 0
    for v in fuzzer.world.variables:
        n = np.dtype(v.dtype).itemsize * math.prod(v.shape)
        parts.append(payload[start : start + n])
        start += n
    assert start == len(payload)
    return parts


def _write_segment(fuzzer: Fuzzer, offer: pb.SharedMemory) -> None:
    """Copies the good snapshot into the offered segment, each variable at its offset, as a client does."""
    with open(offer.path, "r+b") as segment:
        assert os.fstat(segment.fileno()).st_size == offer.size
        for offset, part in zip(offer.offsets, _parts(fuzzer), strict=False):
            segment.seek(offset)
            segment.write(part)


def shared_memory(fuzzer: Fuzzer, scenario: Scenario) -> None:
    header, plan = scenario.payload
    call, decision, started = _open(fuzzer, header)
    exact: Code | None
    try:
        if isinstance(decision, Outcome):
            _judge_save(fuzzer, scenario.category, header, decision, None)
            return
        assert decision.accepted, f"the lane was not idle: {decision.reason}"
        offer = decision.shared_memory if decision.HasField("shared_memory") else None
        assert header.shared_memory or offer is None, "a segment offered to a save that did not ask"
        written = pb.SaveRequest(shared_memory_written=pb.SharedMemoryWritten())
        chunks = [pb.SaveRequest(chunk=c) for c in fuzzer.world.good_chunks]
        if offer is not None:
            fuzzer.offers[header.run] = offer
            _write_segment(fuzzer, offer)
        requests = {
            "written": [written],
            "written-then-chunk": [written, chunks[0]],
            "written-twice": [written, written],
            "chunks-instead": chunks,
            "written-unoffered": [written],
        }[plan]
        if plan == "chunks-instead":
            exact = Code.OK
        elif plan == "written" and offer is not None:
            exact = Code.OK
        else:
            exact = Code.INVALID_ARGUMENT
        outcome = _send_after_accept(call, requests, started)
    finally:
        call.close()
    _judge_save(fuzzer, f"{scenario.category}/{'offered' if offer else 'none'}", header, outcome, exact)


def held_save(fuzzer: Fuzzer, scenario: Scenario) -> None:
    """A save decided under the busy lock, with the segment and lock an ordinary save was offered."""
    header, plan = scenario.payload
    offer = fuzzer.offers.get(header.run)
    if offer is None or not offer.lock_path:  # learn them first, with an ordinary shared-memory save
        learn = pb.SaveHeader()
        learn.CopyFrom(header)
        learn.shared_memory = True
        shared_memory(fuzzer, Scenario("held/learn", "shm", (learn, "written")))
        offer = fuzzer.offers.get(header.run)
        if offer is None or not offer.lock_path:
            return  # this daemon offers no shared memory: nothing to hold
    header.held.CopyFrom(pb.HeldSave(segment_path=offer.path, lock_path=offer.lock_path))
    exact: Code | None = Code.OK
    if plan == "held-bogus-lock":
        header.held.lock_path, exact = str(fuzzer.world.outside / "lock"), Code.FAILED_PRECONDITION
    elif plan == "held-blocking":
        header.blocking, exact = True, Code.INVALID_ARGUMENT
    elif plan == "held-empty-paths":
        header.held.segment_path, exact = "", Code.INVALID_ARGUMENT
    elif plan == "held-unlocked":
        exact = None  # the contract leaves a held save nobody holds the lock for to the daemon
    lock = os.open(offer.lock_path, os.O_RDWR) if plan == "held" else None
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the lane is idle: nobody holds it
            _write_segment(fuzzer, offer)
        call, decision, started = _open(fuzzer, header)
        try:
            if isinstance(decision, Outcome):
                outcome = decision
            else:
                assert decision.accepted, decision
                offered = decision.HasField("shared_memory")
                written = [pb.SaveRequest(shared_memory_written=pb.SharedMemoryWritten())]
                requests = written if offered else [pb.SaveRequest(chunk=c) for c in fuzzer.world.good_chunks]
                outcome = _send_after_accept(call, requests, started)
        finally:
            call.close()
    finally:
        if lock is not None:
            os.close(lock)  # releases the flock
    _judge_save(fuzzer, scenario.category, header, outcome, exact)


# --- Reads, their answers checked against their headers ---


def _check_chunk(chunk: pb.Chunk, where: str) -> None:
    assert crc32c.crc32c(chunk.data) == chunk.crc32c, f"a chunk's CRC32C does not match its data: {where}"


def restore(fuzzer: Fuzzer, scenario: Scenario) -> None:
    """Restore: a header, then the payload from 0, contiguous, each chunk whole, snapshot_bytes in all."""
    started, received, header = time.monotonic(), 0, None
    try:
        for response in fuzzer.stub.Restore(scenario.payload, timeout=RPC_TIMEOUT):
            if header is None:
                assert response.HasField("header"), response
                header = response.header
                continue
            assert response.HasField("chunk") and response.chunk.offset == received, response
            _check_chunk(response.chunk, scenario.category)
            received += len(response.chunk.data)
        assert header is not None and received == header.snapshot_bytes, (header, received)
        outcome = Outcome(Code.OK, seconds=time.monotonic() - started)
    except grpc.RpcError as e:
        outcome = Outcome(e.code(), e.details() or "", seconds=time.monotonic() - started)
    fuzzer.judge(scenario, outcome)


def _asked(request: pb.RestoreFilesRequest, files: dict[str, pb.RestoreFile]) -> list[tuple[str, int, int]]:
    """(path, start, end) of each range the answer must carry, in order (none for the header only: ranges unread)."""
    if request.header_only:
        return []
    if not request.ranges:
        return [(path, 0, f.size) for path, f in files.items()]
    asked = []
    for r in request.ranges:
        assert r.path in files, f"answered OK for a range of a file it does not list: {r.path!r}"
        end = files[r.path].size if r.length == 0 else r.offset + r.length
        assert end <= files[r.path].size, f"answered OK for a range past its file: {r}"
        asked.append((r.path, r.offset, end))
    return asked


def _files_sent(request: pb.RestoreFilesRequest, header: pb.RestoreFilesHeader, chunks: list[pb.Chunk]) -> None:
    """The chunks are exactly the asked ranges, in order; every file sent whole is the file the manifest lists."""
    files = {f.path: f for f in header.files}
    assert len(files) == len(header.files) and header.files, header
    expected = _asked(request, files)
    chunks = iter(chunks)
    total = 0
    for path, start, end in expected:
        data = b""
        while len(data) < end - start:
            chunk = next(chunks, None)
            assert chunk is not None, f"the answer ended inside {path} [{start}, {end})"
            assert chunk.path == path and chunk.offset == start + len(data), (chunk.path, chunk.offset, path, start)
            _check_chunk(chunk, path)
            data += chunk.data
        assert len(data) == end - start, (path, start, end, len(data))
        total += len(data)
        if start == 0 and end == files[path].size:
            assert crc32c.crc32c(data) == files[path].crc32c, f"{path} sent whole is not the file its manifest lists"
    assert next(chunks, None) is None, "chunks past the asked ranges"
    assert total == header.payload_bytes, (total, header.payload_bytes)


def _files_staged(request: pb.RestoreFilesRequest, header: pb.RestoreFilesHeader, staged: pb.StagedFiles) -> None:
    """The staged files are in the staging dir, at their full sizes; those asked whole are the manifest's."""
    directory = Path(staged.dir)
    assert directory.parent == Path(header.staging_dir), (staged.dir, header.staging_dir)
    files = {f.path: f for f in header.files}
    whole = {path for path, start, end in _asked(request, files) if start == 0 and end == files[path].size}
    for path in staged.paths:
        assert path in files, f"staged {path!r}, a file the header does not list"
        data = (directory / path).read_bytes()
        assert len(data) == files[path].size, (path, len(data), files[path].size)
        if path in whole:
            assert crc32c.crc32c(data) == files[path].crc32c, f"staged {path} is not the file its manifest lists"


def restore_files(fuzzer: Fuzzer, scenario: Scenario) -> None:
    request: pb.RestoreFilesRequest = scenario.payload
    started, header, chunks, staged = time.monotonic(), None, [], None
    call = fuzzer.stub.RestoreFiles(request, timeout=RPC_TIMEOUT)
    try:
        for response in call:
            item = response.WhichOneof("item")
            assert (item == "header") == (
                header is None
            ), f"{item} where the header {'is due' if header is None else 'was'}"
            if item == "header":
                header = response.header
            elif item == "chunk":
                assert not request.stage, "a chunk in a staged answer"
                chunks.append(response.chunk)
            else:
                assert request.stage and header.staging_dir, "staged files without a staging dir or the ask"
                staged = response.staged
                _files_staged(request, header, staged)
                call.cancel()  # the client took them: the daemon deletes them now
                break
        assert header is not None
        if staged is None:
            _files_sent(request, header, chunks)
        outcome = Outcome(Code.OK, seconds=time.monotonic() - started)
    except grpc.RpcError as e:
        if e.code() is Code.CANCELLED and staged is not None:
            outcome = Outcome(Code.OK, seconds=time.monotonic() - started)
        else:
            outcome = Outcome(e.code(), e.details() or "", seconds=time.monotonic() - started)
    if request.stage and header is not None and not header.staging_dir:
        scenario.exact = Code.INVALID_ARGUMENT  # the daemon named no staging dir
    fuzzer.judge(scenario, outcome)
    if staged is not None:
        fuzzer.staged_restores += 1
        wait_until(lambda: not Path(staged.dir).exists(), "the daemon to delete the staged files", RPC_TIMEOUT)


SEQUENCES: dict[str, Callable[[Fuzzer, Scenario], None]] = {
    "overlap": overlap,
    "cancel": cancel_mid_upload,
    "incremental": incremental,
    "shm": shared_memory,
    "held": held_save,
    "Restore": restore,
    "RestoreFiles": restore_files,
}
