"""The command line, parsed: pure, with no side effects (running lives in `main`)."""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from checkpointd import __version__
from checkpointd.cli.flags import NoTokenOnCommandLine, unrecognized, with_flags
from checkpointd.cli.serve_flags import WORK_DIR, add_serve
from checkpointd.core.config import DEFAULT_SHM_ROOT, ServeConfig
from checkpointd.protocol.address import DEFAULT_PORT, AddressError, check_address

_LOGGER = logging.getLogger("checkpointd")


DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_PORT}"
"""Where flush, status and close look for a daemon without --address."""

STATUS_TIMEOUT = 30.0
"""Seconds `status` waits for an answer unless --timeout says otherwise."""


@dataclass(frozen=True)
class OpsCommand:
    """flush, status or close against a running daemon."""

    name: str
    address: str
    run: str | None
    timeout: float | None
    as_json: bool = False
    tls: bool = False  # TLS with the system's roots, when no tls_ca is given
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    token_file: Path | None = None  # else the CHECKPOINTD_TOKEN environment variable
    stored: bool = False  # status: the runs with committed saves in the daemon's store

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.tls_ca is not None or self.tls_cert is not None


@dataclass(frozen=True)
class VerifyCommand:
    """verify: check save dirs against their manifests, offline."""

    paths: tuple[Path, ...]
    as_json: bool = False
    progress: bool | None = None  # None: only when stderr is a terminal
    urls: tuple[str, ...] = ()  # s3://BUCKET[/PREFIX[/RUN]]: committed saves in an object store
    s3_endpoint_url: str | None = None
    s3_region: str | None = None


@dataclass(frozen=True)
class FetchCommand:
    """fetch: copy a committed save from an object store to a local dir, checked."""

    root: str
    save: str  # RUN[/EXPORT_DIR]
    dest: Path
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    progress: bool | None = None


# The defaults, written once: ServeConfig's (the help text quotes them).
def _address(text: str) -> str:
    try:
        return check_address(text)
    except AddressError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser, and each command's (for errors that print its usage)."""
    parser = argparse.ArgumentParser(
        prog="checkpointd",
        description="An asynchronous checkpoint service for TF-Agents.",
    )
    parser.add_argument("--version", action="version", version=f"checkpointd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_serve(sub)

    for name, text in (
        ("flush", "wait until every accepted save is durable (exit 1 past --timeout)"),
        ("status", "show runs, in-flight saves, counts and last success"),
        ("close", "flush one run and end its lane"),
    ):
        cmd = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".", allow_abbrev=False)
        cmd.add_argument(
            "--address",
            default=DEFAULT_ADDRESS,
            type=_address,
            help=f"daemon HOST:PORT (default: {DEFAULT_ADDRESS})",
        )
        cmd.add_argument(
            "--run", required=name == "close", help="one run" + ("" if name == "close" else " (default: all runs)")
        )
        if name == "status":
            cmd.add_argument(
                "--timeout",
                type=float,
                default=STATUS_TIMEOUT,
                help=f"seconds to wait for the daemon's answer; exit 2 without one (default: {STATUS_TIMEOUT:g})",
            )
        else:
            cmd.add_argument(
                "--timeout",
                type=float,
                help="seconds the accepted saves may take to become durable: exit 1 if some are still in "
                "flight then, exit 2 if no daemon answered within it (default: no limit)",
            )
        if name == "status":
            cmd.add_argument("--json", action="store_true", dest="as_json", help="machine-readable output")
            cmd.add_argument(
                "--stored",
                action="store_true",
                help="list the runs with committed saves in the daemon's store instead (any daemon's, on a "
                "shared s3:// root): newest save, its step and age, lease holder; at most 1000 runs",
            )
        cmd.add_argument(
            "--tls",
            action="store_true",
            help="connect with TLS, trusting the system's CAs (implied by --tls-ca/--tls-cert)",
        )
        cmd.add_argument("--tls-ca", type=Path, metavar="FILE", help="PEM CA that signed the daemon's certificate")
        cmd.add_argument(
            "--tls-cert", type=Path, metavar="FILE", help="PEM client certificate, for a daemon with --tls-client-ca"
        )
        cmd.add_argument("--tls-key", type=Path, metavar="FILE", help="PEM key of --tls-cert")
        cmd.add_argument(
            "--token-file",
            type=Path,
            metavar="FILE",
            help="file holding the bearer token (default: the CHECKPOINTD_TOKEN environment variable)",
        )
        cmd.add_argument("--token", nargs="?", action=NoTokenOnCommandLine, help=argparse.SUPPRESS)

    verify = sub.add_parser(
        "verify",
        help="check saves against their checkpointd.manifest.json (offline)",
        description="Check save dirs, or every save dir under a run or root dir, against their "
        "checkpointd.manifest.json: every listed file present with its size and CRC32C, no "
        "other file. Exit 0 if all are OK, 1 if any is not, 2 if a path does not exist or the bucket cannot be used.",
    )
    verify.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="a save dir, or a dir to search for save dirs, or s3://BUCKET[/PREFIX[/RUN[/EXPORT_DIR]]] (every object read back)",
    )
    fetch = sub.add_parser(
        "fetch",
        help="copy a committed save from an s3:// root to a local dir, checked against its manifest",
        description="Copy RUN's newest committed save (or RUN/EXPORT_DIR) from --root s3://BUCKET[/PREFIX] "
        "to DEST, checked against its manifest. Credentials come from the standard AWS environment "
        "variables or config files. Exit 0 when fetched, 1 if there is no such save or it is corrupt, "
        "2 for bad arguments, credentials or bucket.",
    )
    fetch.add_argument("--root", required=True, help="the daemons' s3://BUCKET[/PREFIX]")
    fetch.add_argument("save", metavar="RUN[/EXPORT_DIR]")
    fetch.add_argument("dest", type=Path, metavar="DEST", help="a new (or empty) local dir")
    fetch.add_argument("--progress", action="store_true", default=None, help="show bytes fetched on stderr")
    for cmd in (verify, fetch):
        cmd.add_argument("--s3-endpoint-url", help="another S3 server than AWS's")
        cmd.add_argument("--s3-region", help="the bucket's region (default: the AWS config's)")
    verify.add_argument("--json", action="store_true", dest="as_json", help="machine-readable output")
    verify.add_argument(
        "--progress",
        action="store_true",
        default=None,
        help="show bytes checked on stderr (default: only when stderr is a terminal)",
    )
    return parser, dict(sub.choices)


def config_from_args(argv: Sequence[str]) -> tuple[ServeConfig | OpsCommand | VerifyCommand | FetchCommand, str]:
    """Parses a command line; no side effects.

    Returns:
        The serve config, the ops or verify command, and the log level.
    """
    parser, commands = _parser()
    # Unknown flags are reported by the command's own parser (its usage, and
    # the flag meant), not the top-level one's, which knows no command's flags.
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        commands[args.command].error(unrecognized(unknown, commands[args.command]))
    if args.command == "serve":
        s3_root = args.root.startswith("s3://")
        if not args.root.strip():
            commands["serve"].error(
                "--root is empty: give the dir to write runs under (e.g. --root ./checkpoints) or "
                "s3://BUCKET[/PREFIX]; an empty one would serve the current directory"
            )
        if args.work_dir is not None and not s3_root:
            commands["serve"].error(
                f"--work-dir applies to s3:// roots only; a local --root ({args.root}) keeps the daemon's "
                "templates and staging in ROOT/.checkpointd/: drop --work-dir"
            )
        try:
            config = ServeConfig(
                root=(args.work_dir or WORK_DIR) if s3_root else Path(args.root),
                s3_url=args.root if s3_root else None,
                s3_endpoint_url=args.s3_endpoint_url,
                s3_region=args.s3_region,
                s3_grace_seconds=args.s3_grace_seconds,
                s3_read_timeout=args.s3_read_timeout,
                lease_seconds=args.lease_seconds,
                lease_idle_seconds=args.lease_idle_seconds,
                host=args.host,
                port=args.port,
                port_file=args.port_file,
                metrics_host=args.metrics_host,
                metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                metrics_port_file=args.metrics_port_file,
                grace_seconds=args.grace_seconds,
                notice_window_seconds=args.notice_window,
                max_snapshot_bytes=args.max_snapshot_bytes,
                max_template_bytes=args.max_template_bytes,
                max_workers=args.max_workers,
                fsync=not args.no_fsync,
                group_commit=not args.no_group_commit,
                incremental_path=args.incremental_path,
                upload_timeout_seconds=args.upload_timeout,
                max_concurrent_uploads=args.max_concurrent_uploads,
                admission_wait_seconds=args.admission_wait,
                keep_last=args.keep_last,
                keep_every_steps=args.keep_every_steps,
                max_staging_bytes=args.max_staging_bytes,
                tls_cert=args.tls_cert,
                tls_key=args.tls_key,
                tls_client_ca=args.tls_client_ca,
                token_file=args.token_file,
                insecure=args.insecure,
                write_nice=args.write_nice,
                shm_root=None if args.no_shm else (args.shm_dir or DEFAULT_SHM_ROOT),
            )
        except ValueError as exc:
            commands["serve"].error(with_flags(str(exc), commands["serve"]))
        return config, args.log_level
    if args.command == "verify":
        return VerifyCommand(
            tuple(Path(p) for p in args.paths if not p.startswith("s3://")),
            args.as_json,
            args.progress,
            urls=tuple(p for p in args.paths if p.startswith("s3://")),
            s3_endpoint_url=args.s3_endpoint_url,
            s3_region=args.s3_region,
        ), "WARNING"
    if args.command == "fetch":
        if not args.root.startswith("s3://"):
            commands["fetch"].error("--root must be s3://BUCKET[/PREFIX] (a local root is read where it is)")
        return FetchCommand(
            args.root, args.save, args.dest, args.s3_endpoint_url, args.s3_region, args.progress
        ), "WARNING"
    if args.timeout is not None and not 0 < args.timeout < math.inf:
        commands[args.command].error("--timeout must be a positive number of seconds")
    if (args.tls_cert is None) != (args.tls_key is None):
        commands[args.command].error("--tls-cert and --tls-key go together: give both or neither")
    command = OpsCommand(
        args.command, args.address, args.run, args.timeout, getattr(args, "as_json", False),
        tls=args.tls, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
        token_file=args.token_file, stored=getattr(args, "stored", False),
    )  # fmt: skip
    return command, "WARNING"
