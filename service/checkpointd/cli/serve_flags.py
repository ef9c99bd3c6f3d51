"""`checkpointd serve`'s flags: pure, like the rest of the parse (the values are checked by ServeConfig)."""

from __future__ import annotations

import argparse
from pathlib import Path

from checkpointd.cli.flags import NoTokenOnCommandLine
from checkpointd.core.config import DEFAULT_METRICS_PORT, ServeConfig
from checkpointd.core.incremental_path import CHOICES

_D = ServeConfig()
WORK_DIR = Path("checkpointd-work")  # serve --work-dir's default, with an s3:// --root


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


def add_serve(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds `serve` and its flags to the top-level parser's commands; returns its parser."""
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
        help=f"with an s3:// --root, the local dir for templates and staging, one per daemon (default: ./{WORK_DIR}); "
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
    security.add_argument("--token", "--tokens", nargs="?", action=NoTokenOnCommandLine, help=argparse.SUPPRESS)
    security.add_argument(
        "--insecure",
        action="store_true",
        help="serve a non-loopback --host with neither TLS nor tokens (logged at WARNING)",
    )
    return serve
