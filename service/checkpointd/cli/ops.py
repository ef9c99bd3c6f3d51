"""The ops side of the CLI: flush, status and close against a running daemon."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import grpc
from google.protobuf import json_format

from checkpointd.cli.parse import OpsCommand
from checkpointd.protocol import credentials
from checkpointd.protocol.codes import error_for
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc as pb_grpc

# Slack on top of a server-side timeout, so the daemon's answer wins the race.
_RPC_SLACK = 5.0


def run(
    command: OpsCommand,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Runs one ops command; returns the process exit code.

    The token comes from `command.token_file`, else from CHECKPOINTD_TOKEN in
    `environ` (default os.environ); unreadable credentials exit 2.
    """
    try:
        channel = _channel(command, os.environ if environ is None else environ)
    except (OSError, ValueError) as exc:
        print(f"checkpointd {command.name}: {exc}", file=err)
        return 2
    with channel:
        stub = pb_grpc.CheckpointServiceStub(channel)
        rpc_timeout = None if command.timeout is None else command.timeout + _RPC_SLACK
        try:
            if command.name == "flush":
                reply = stub.Flush(
                    pb.FlushRequest(run=command.run or "", timeout_seconds=command.timeout or 0),
                    timeout=rpc_timeout,
                )
                runs = ", ".join(reply.runs) or "no runs"
                print(f"flushed: every accepted save is durable ({runs})", file=out)
            elif command.name == "close":
                stub.CloseRun(
                    pb.CloseRunRequest(run=command.run, timeout_seconds=command.timeout or 0),
                    timeout=rpc_timeout,
                )
                print(f"closed run {command.run}", file=out)
            else:
                reply = stub.GetStatus(pb.StatusRequest(run=command.run or ""), timeout=command.timeout or 30)
                if command.as_json:
                    print(json.dumps(status_dict(reply), indent=2), file=out)
                else:
                    print(format_status(reply), file=out)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                print(
                    f"checkpointd {command.name}: cannot reach a daemon at {command.address}: {exc.details()}", file=err
                )
                return 2
            error = error_for(exc.code(), exc.details())
            print(f"checkpointd {command.name}: {type(error).__name__}: {error}", file=err)
            return 1
    return 0


def _channel(command: OpsCommand, environ: Mapping[str, str]) -> grpc.Channel:
    token = environ.get(credentials.TOKEN_ENV, "").strip() or None
    if command.token_file is not None:
        try:
            token = credentials.read_token(command.token_file)
        except OSError as exc:
            raise OSError(f"cannot read --token-file {command.token_file}: {exc.strerror or exc}") from None
    channel_credentials = None
    if command.uses_tls:
        try:
            channel_credentials = credentials.credentials(command.tls_ca, command.tls_cert, command.tls_key)
        except OSError as exc:
            raise OSError(f"cannot read {exc.filename}: {exc.strerror or exc}") from None
    return credentials.open_channel(command.address, channel_credentials, token)


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
    kinds = {pb.SAVED_MODEL: "saved_model", pb.CHECKPOINT: "checkpoint"}
    header = ("RUN", "STATE", "IN FLIGHT", "OK", "SKIPPED", "FAILED", "LAST SUCCESS")
    rows = [header]
    for r in reply.runs:
        if r.HasField("in_flight"):
            f = r.in_flight
            flight = f"{kinds.get(f.kind, '?')} {f.export_dir} (step {f.step}, {_ago(f.started_unix_seconds, now)})"
            if f.waiting:
                flight += f" +{f.waiting} waiting"
        else:
            flight = "-"
        if r.HasField("last_success"):
            s = r.last_success
            last = f"{_ago(s.unix_seconds, now)} step {s.step} {s.path}"
        else:
            last = "never"
        rows.append((r.run, r.state, flight, str(r.saves_ok), str(r.saves_skipped), str(r.saves_failed), last))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1] for row in rows]
    if not reply.runs:
        lines.append("(no runs registered)")
    if reply.draining:
        lines.append("daemon is draining: new saves are refused")
    return "\n".join(lines)
