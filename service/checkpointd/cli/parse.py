"""The command line, parsed: pure, with no side effects (running lives in `main`)."""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from checkpointd import __version__
from checkpointd.cli.flags import unrecognized, with_flags
from checkpointd.core.config import DEFAULT_METRICS_PORT, DEFAULT_SHM_ROOT, ServeConfig
from checkpointd.core.incremental_path import CHOICES
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
_D = ServeConfig()
_WORK_DIR = Path("checkpointd-work")  # serve --work-dir's default, with an s3:// --root


def _human(nbytes: int) -> str:
    """A size as the --max-*-bytes flags take it: 8G, 512M, or bytes."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if nbytes and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    text = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 8G)") from None


def _address(text: str) -> str:
    try:
        return check_address(text)
    except AddressError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _NoTokenOnCommandLine(argparse.Action):
    """`--token`: refused without echoing its value (argparse's own error would)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        parser.error(
            "tokens never go on the command line (ps and shell history show them): "
            "use --token-file FILE or the environment variable instead"
        )


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser, and each command's (for errors that print its usage)."""
    parser = argparse.ArgumentParser(
        prog="checkpointd",
        description="An asynchronous checkpoint service for TF-Agents.",
    )
    parser.add_argument("--version", action="version", version=f"checkpointd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # allow_abbrev=False: a mistyped `--token SECRET` must be an error, not `--token-file SECRET`.
    serve = sub.add_parser(
        "serve",
        help="run the daemon",
        description="Run the daemon until SIGTERM/SIGINT, then drain.",
        allow_abbrev=False,
    )
    serve.add_argument(
        "--root",
        default=str(_D.root),
        help=f"where runs are written: a local dir, or s3://BUCKET[/PREFIX] (default: ./{_D.root})",
    )
    serve.add_argument(
        "--work-dir",
        type=Path,
        help=f"with an s3:// --root, the local dir for templates and staging, one per daemon (default: ./{_WORK_DIR}); "
        "a local --root keeps them in ROOT/.checkpointd/",
    )
    serve.add_argument(
        "--s3-endpoint-url", help="with an s3:// --root, the S3 server (default: AWS's); credentials come from "
        "the standard AWS environment variables or config files, never from flags",
    )  # fmt: skip
    serve.add_argument("--s3-region", help="with an s3:// --root, the bucket's region (default: the AWS config's)")
    serve.add_argument(
        "--s3-grace-seconds",
        type=float,
        default=_D.s3_grace_seconds,
        help="with an s3:// --root, how old uncommitted objects must be before the bucket's tidy, run once the "
        f"daemon serves, deletes them; keep it above the longest save (default: {_D.s3_grace_seconds:g})",
    )
    serve.add_argument(
        "--s3-read-timeout",
        type=float,
        default=_D.s3_read_timeout,
        metavar="SECONDS",
        help="with an s3:// --root, how long an S3 request may wait for the server's next bytes before it is "
        f"cut and retried: a stalled server fails the save instead of holding its run (default: {_D.s3_read_timeout:g})",
    )
    serve.add_argument(
        "--lease-seconds",
        type=float,
        default=_D.lease_seconds,
        metavar="SECONDS",
        help="with an s3:// --root, the ttl of the run leases through which daemons sharing the bucket agree "
        "who writes a run: a run another daemon holds is refused ABORTED until that daemon releases it or, "
        f"gone, its lease expires; >= 3 (default: {_D.lease_seconds:g})",
    )
    serve.add_argument(
        "--lease-idle-seconds",
        type=float,
        default=_D.lease_idle_seconds,
        metavar="SECONDS",
        help="with an s3:// --root, release the lease of a run with no save for this long, so a trainer that "
        "moved to another host can take its run there; >= --lease-seconds "
        f"(default: {_D.lease_idle_seconds:g})",
    )
    serve.add_argument(
        "--host", default=_D.host, help=f"gRPC bind address (default: {_D.host}; 0.0.0.0 or [::] for remote trainers)"
    )
    serve.add_argument("--port", type=int, default=_D.port, help=f"gRPC port, 0 = any free port (default: {_D.port})")
    serve.add_argument("--port-file", type=Path, help="write the bound gRPC port here once serving")
    serve.add_argument(
        "--metrics-host", default=_D.metrics_host, help=f"/metrics bind address (default: {_D.metrics_host})"
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help=f"/metrics port, 0 = any free port, -1 = off (default: {DEFAULT_METRICS_PORT})",
    )
    serve.add_argument("--metrics-port-file", type=Path, help="write the bound metrics port here once serving")
    serve.add_argument(
        "--notice-window",
        type=float,
        default=_D.notice_window_seconds,
        metavar="SECONDS",
        help="on SIGTERM, keep taking saves of the runs registered here for up to this long (trainers stopped "
        "with the daemon get their final save in) while refusing new runs, then drain; it ends early once every "
        f"run has sent its save on notice or was closed; 0 = refuse every save at once (default: {_D.notice_window_seconds:g})",
    )
    serve.add_argument(
        "--grace-seconds",
        type=float,
        default=_D.grace_seconds,
        help=f"on SIGTERM, time accepted saves get to finish after the notice window (default: {_D.grace_seconds:g})",
    )
    serve.add_argument(
        "--max-snapshot-bytes",
        type=_size,
        default=_D.max_snapshot_bytes,
        help=f"largest snapshot one save may carry (default: {_human(_D.max_snapshot_bytes)})",
    )
    serve.add_argument(
        "--max-template-bytes",
        type=_size,
        default=_D.max_template_bytes,
        help=f"largest template a run may register (default: {_human(_D.max_template_bytes)})",
    )
    serve.add_argument(
        "--max-workers",
        type=int,
        default=_D.max_workers,
        help=f"gRPC handler threads; each open save holds one (default: {_D.max_workers})",
    )
    serve.add_argument(
        "--write-nice",
        type=int,
        default=_D.write_nice,
        metavar="N",
        help=f"nice value (0-19) of the threads that write saves, so training on this machine gets the CPU first; 0 = normal priority (default: {_D.write_nice})",
    )
    serve.add_argument("--no-fsync", action="store_true", help="skip fsync before publishing (throwaway runs only)")
    serve.add_argument(
        "--no-group-commit",
        action="store_true",
        help="fsync each small save's files and dirs on its own, instead of one shared syncfs of the root's "
        "filesystem for the saves that commit together (for a root on a filesystem busy with other writers)",
    )
    serve.add_argument(
        "--incremental-path",
        choices=CHOICES,
        default=_D.incremental_path,
        help="how an incremental save's unchanged chunks get into it: auto (per save, copied from the base "
        "save or received, whichever this root's saves measured cheaper), copy (always from the base: a clone "
        "on XFS/Btrfs, a server-side copy on S3), receive (never: the trainer sends every byte)",
    )
    serve.add_argument(
        "--max-concurrent-uploads",
        type=int,
        default=_D.max_concurrent_uploads,
        metavar="N",
        help=f"saves admitted at once over all runs; past it RESOURCE_EXHAUSTED (default: {_D.max_concurrent_uploads})",
    )
    serve.add_argument(
        "--admission-wait",
        type=float,
        default=_D.admission_wait_seconds,
        metavar="S",
        help="how long a save at --max-concurrent-uploads or --max-staging-bytes waits for room before it is "
        f"refused RESOURCE_EXHAUSTED: a burst of saves from many trainers waits, not fails "
        f"(default: {_D.admission_wait_seconds}; 0 refuses at once)",
    )
    serve.add_argument(
        "--max-staging-bytes",
        type=_size,
        metavar="SIZE",
        help="snapshot bytes held in memory at once over all saves; past it RESOURCE_EXHAUSTED (default: half the machine's memory)",
    )
    serve.add_argument(
        "--keep-last",
        type=int,
        metavar="N",
        help="retention: keep each run's newest N saves of each kind, delete older ones in the background (default: keep all)",
    )
    serve.add_argument(
        "--keep-every-steps",
        type=int,
        metavar="K",
        help="retention: also keep older saves at steps that are multiples of K (with --keep-last)",
    )
    serve.add_argument(
        "--upload-timeout",
        type=float,
        default=_D.upload_timeout_seconds,
        metavar="SECONDS",
        help=f"fail an accepted save whose snapshot has not arrived this long after its accept, freeing the run (default: {_D.upload_timeout_seconds:g})",
    )
    serve.add_argument(
        "--shm-dir",
        type=Path,
        metavar="DIR",
        help="tmpfs where same-host trainers get a shared-memory segment per run instead of streaming snapshots over gRPC (default: /dev/shm where it exists)",
    )
    serve.add_argument("--no-shm", action="store_true", help="no shared memory: every snapshot comes over gRPC")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    security = serve.add_argument_group(
        "security",
        "Off by default on a loopback --host. Any other --host needs TLS, tokens, or --insecure.",
    )
    security.add_argument(
        "--tls-cert",
        type=Path,
        metavar="FILE",
        help="PEM server certificate (chain); with --tls-key, the gRPC port speaks TLS only",
    )
    security.add_argument("--tls-key", type=Path, metavar="FILE", help="PEM private key of --tls-cert")
    security.add_argument(
        "--tls-client-ca",
        type=Path,
        metavar="FILE",
        help="PEM CA bundle: require client certificates it signed (mutual TLS)",
    )
    security.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="bearer tokens, one per line, # comments; also CHECKPOINTD_TOKENS=tok1,tok2 (never on the command line)",
    )
    security.add_argument("--token", "--tokens", nargs="?", action=_NoTokenOnCommandLine, help=argparse.SUPPRESS)
    security.add_argument(
        "--insecure",
        action="store_true",
        help="serve a non-loopback --host with neither TLS nor tokens (logged at WARNING)",
    )

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
        cmd.add_argument("--token", nargs="?", action=_NoTokenOnCommandLine, help=argparse.SUPPRESS)

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
                root=(args.work_dir or _WORK_DIR) if s3_root else Path(args.root),
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
