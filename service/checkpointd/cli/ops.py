"""The ops side of the CLI: flush, status and close against a running daemon.

`status --stored` asks the daemon for the runs its store holds (StatusRequest.stored):
on an s3:// root shared by a fleet, any daemon answers for the whole bucket.

Exit codes: 0 done; 1 the daemon answered that saves were still in flight
when --timeout passed (flush, close); 2 the command could not do its job: no
daemon answered at the address (nothing listening, not checkpointd, no
answer in time), it refused the credentials, or it has no such run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import grpc
from google.protobuf import json_format

from checkpointd.cli.parse import DEFAULT_ADDRESS, OpsCommand
from checkpointd.protocol import credentials
from checkpointd.protocol.address import with_default_port
from checkpointd.protocol.codes import error_for
from checkpointd.protocol.kinds import from_wire
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc as pb_grpc

# flush and close ask the daemon to wait --timeout seconds; the call itself
# gets this much longer, so the daemon's "still in flight" answer (exit 1)
# arrives before the call's own deadline, which means no daemon answered (exit 2).
ANSWER_SLACK = 1.0

SAVES_BUSY = 1
FAILED = 2


def run(
    command: OpsCommand,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Runs one ops command; returns the process exit code (see the module docstring).

    The token comes from `command.token_file`, else from CHECKPOINTD_TOKEN in
    `environ` (default os.environ); unreadable credentials exit 2.
    """
    try:
        channel, token_from = _channel(command, os.environ if environ is None else environ)
    except (OSError, ValueError) as exc:
        print(f"checkpointd {command.name}: {exc}", file=err)
        return FAILED
    with channel:
        stub = pb_grpc.CheckpointServiceStub(channel)
        waits = command.name in ("flush", "close")  # the daemon waits up to --timeout
        deadline = None if command.timeout is None else command.timeout + (ANSWER_SLACK if waits else 0.0)
        started = time.monotonic()
        try:
            if command.name == "flush":
                reply = stub.Flush(
                    pb.FlushRequest(run=command.run or "", timeout_seconds=command.timeout or 0),
                    timeout=deadline,
                )
                runs = ", ".join(reply.runs) or "no runs"
                print(f"flushed: every accepted save is durable ({runs})", file=out)
            elif command.name == "close":
                stub.CloseRun(
                    pb.CloseRunRequest(run=command.run, timeout_seconds=command.timeout or 0),
                    timeout=deadline,
                )
                print(f"closed run {command.run}", file=out)
            else:
                request = pb.StatusRequest(run=command.run or "", stored=command.stored)
                status = stub.GetStatus(request, timeout=deadline)
                if command.as_json:
                    print(json.dumps(status_dict(status), indent=2), file=out)
                elif command.stored:
                    print(format_stored(status, command.run), file=out)
                else:
                    print(format_status(status), file=out)
        except grpc.RpcError as exc:
            # The call's own deadline passed only if the daemon did not answer
            # by then; its "still in flight" comes ANSWER_SLACK earlier.
            unanswered = deadline is not None and time.monotonic() - started >= deadline - ANSWER_SLACK / 2
            code, message = _failure(command, exc, unanswered, token_from)
            print(f"checkpointd {command.name}: {message}", file=err)
            return code
    return 0


def _default_hint(command: OpsCommand) -> str:
    """For the default address: that it is the default, and the flag that names another."""
    if command.address != DEFAULT_ADDRESS:
        return ""
    return " (the default address: give the daemon's with --address HOST:PORT, its serve --host and --port)"


def _failure(command: OpsCommand, exc: grpc.RpcError, unanswered: bool, token_from: str | None) -> tuple[int, str]:
    """The exit code and message for a failed call, saying what to do about it."""
    code, details = exc.code(), exc.details() or exc.code().name
    address = with_default_port(command.address)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and unanswered:
        return FAILED, (
            f"no answer from {address}{_default_hint(command)} within {command.timeout:g}s (--timeout): is a "
            "checkpointd daemon listening there, and is it its gRPC --port?"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # the daemon's own answer
        return SAVES_BUSY, f"{type(error_for(code, details)).__name__}: {details}"
    if code == grpc.StatusCode.UNAVAILABLE:
        return FAILED, f"cannot reach a daemon at {address}{_default_hint(command)}: {details}"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return FAILED, (
            f"the address {address} does not serve checkpointd (it answered: {details}); give the "
            "daemon's gRPC --port with --address HOST:PORT, not its metrics port or another service's"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED and token_from is None:
        return FAILED, (
            f"the daemon at {address} wants a bearer token and none was given: give it with "
            "--token-file FILE or the CHECKPOINTD_TOKEN environment variable"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return FAILED, f"the daemon at {address} refused the token from {token_from} ({details}): use one of its tokens"
    error = error_for(code, details)
    return FAILED, f"{type(error).__name__}: {error}"


def _channel(command: OpsCommand, environ: Mapping[str, str]) -> tuple[grpc.Channel, str | None]:
    """The channel, and where its token came from (None: no token)."""
    token = environ.get(credentials.TOKEN_ENV, "").strip() or None
    token_from = credentials.TOKEN_ENV if token else None
    if command.token_file is not None:
        try:
            token = credentials.read_token(command.token_file)
        except OSError as exc:
            raise OSError(f"cannot read --token-file {command.token_file}: {exc.strerror or exc}") from None
        token_from = f"--token-file {command.token_file}"
    channel_credentials = None
    if command.uses_tls:
        try:
            channel_credentials = credentials.credentials(command.tls_ca, command.tls_cert, command.tls_key)
        except OSError as exc:
            raise OSError(f"cannot read {exc.filename}: {exc.strerror or exc}") from None
    return credentials.open_channel(command.address, channel_credentials, token), token_from


def status_dict(reply: pb.StatusResponse) -> dict[str, Any]:
    """The status reply as plain JSON-able data (every field present)."""
    # protobuf 4.x spelling; pinned < 5 because TensorFlow 2.15 is.
    return json_format.MessageToDict(reply, preserving_proto_field_name=True, including_default_value_fields=True)


def _ago(unix_seconds: float, now: float) -> str:
    seconds = max(0.0, now - unix_seconds)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def format_status(reply: pb.StatusResponse, now: float | None = None) -> str:
    """A table of runs for people."""
    now = time.time() if now is None else now
    header = ("RUN", "STATE", "IN FLIGHT", "OK", "SKIPPED", "FAILED", "LAST SUCCESS")
    rows = [header]
    for r in reply.runs:
        if r.HasField("in_flight"):
            f = r.in_flight
            kind = from_wire(f.kind)
            flight = (
                f"{kind.value if kind else '?'} {f.export_dir} (step {f.step}, {_ago(f.started_unix_seconds, now)})"
            )
            if f.waiting:
                flight += f" +{f.waiting} waiting"
        else:
            flight = "-"
        if r.HasField("last_success"):
            s = r.last_success
            last = f"{_ago(s.unix_seconds, now)} step {s.step} {s.path}"
            if s.bytes_copied:  # an incremental save: how much of it travelled
                sent = s.bytes_received / (s.bytes_received + s.bytes_copied)
                last += f" (sent {100 * sent:.1f}%, rest copied from its base)"
        else:
            last = "never"
        rows.append((r.run, r.state, flight, str(r.saves_ok), str(r.saves_skipped), str(r.saves_failed), last))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1] for row in rows]
    if not reply.runs:
        lines.append("(no runs registered)")
    if reply.draining and reply.notice_seconds_left > 0:
        lines.append(
            f"daemon is draining (on notice): new runs are refused; saves of the runs above are taken for "
            f"{reply.notice_seconds_left:.1f}s more"
        )
    elif reply.draining:
        lines.append("daemon is draining: new saves are refused")
    return "\n".join(lines)


def _holder(run: pb.StoredRun) -> str:
    if not run.HasField("lease_holder"):
        return "-"
    return run.lease_holder or "this daemon"


def format_stored(reply: pb.StatusResponse, run: str | None = None, now: float | None = None) -> str:
    """A table of the runs with committed saves in the store, for people."""
    now = time.time() if now is None else now
    header = ("RUN", "FOLDER", "NEWEST SAVE", "STEP", "AGE", "SAVES", "HOLDER")
    rows = [header]
    for r in reply.stored_runs:
        kind = from_wire(r.kind)
        newest = f"{kind.value if kind else '?'} {r.export_dir}"
        rows.append((r.run, r.folder, newest, str(r.step), _ago(r.unix_seconds, now), str(r.saves), _holder(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1] for row in rows]
    if not reply.stored_runs:
        where = f"of run {run}" if run else f"in any of the {reply.stored_folders} run folders"
        lines.append(f"(no committed saves {where} in the daemon's store)")
    if reply.stored_truncated:
        lines.append(
            f"capped: showing the first {len(reply.stored_runs)} runs by folder of {reply.stored_folders} "
            "folders; give --run RUN for another"
        )
    return "\n".join(lines)
