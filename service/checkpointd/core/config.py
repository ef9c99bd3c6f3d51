"""The daemon's configuration: frozen, validated, and free of argparse."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from checkpointd.core import lease
from checkpointd.core.incremental_path import ChooserConfig
from checkpointd.core.retention import RetentionPolicy
from checkpointd.protocol.address import DEFAULT_PORT

DEFAULT_METRICS_PORT = 9431
# Where same-host trainers get shared memory unless told otherwise (Linux's
# tmpfs); the server checks at start that it is there.
DEFAULT_SHM_ROOT = Path("/dev/shm")
GiB = 1 << 30


@dataclass(frozen=True)
class ServeConfig:
    """Everything `checkpointd serve` needs.

    Attributes:
        root: where run folders are written; `<root>/.checkpointd/` holds the
            daemon's own state (templates, staging). With `s3_url`, a local
            work dir for that state only.
        s3_url: `s3://BUCKET[/PREFIX]` to commit saves to an object store
            (`checkpointd.storage.s3`); None: saves go under `root`.
        s3_endpoint_url: another S3 server than AWS's (e.g. radosgw's).
        s3_region: the bucket's region; None: the AWS config's.
        s3_grace_seconds: how old an uncommitted object or multipart upload
            must be before the bucket's tidy (run once the daemon serves)
            deletes it (a save in progress, a peer's or its own, is younger).
        s3_read_timeout: seconds an S3 request may wait for the server's next
            bytes before it is cut and retried (`s3.client.make_client`);
            retries end at the save's deadline (`s3.save_requests`).
        lease_seconds: with `s3_url`, the ttl of the run leases through which
            daemons sharing the bucket agree who writes a run
            (`checkpointd.storage.s3.lease`); renewed every third of it.
        lease_idle_seconds: with `s3_url`, a run with no save for this long
            lets go of its lease, so a trainer that died here does not pin
            its run to this daemon; its next save here takes it again.
        host: gRPC bind address.
        port: gRPC port; 0 picks a free one.
        metrics_host: bind address of the /metrics endpoint.
        metrics_port: /metrics port; 0 picks a free one, None disables it.
        port_file: if set, the bound gRPC port is written there once serving.
        metrics_port_file: likewise for the metrics port.
        notice_window_seconds: on SIGTERM, how long the daemon keeps taking
            saves of the runs registered on it (their trainers' final saves,
            when a node is drained) while refusing new runs, before it refuses
            every save and drains; it ends early once each open run has sent
            its save on notice or was closed. 0: refuse every save at once.
        grace_seconds: on SIGTERM, how long accepted saves may take to finish,
            counted from the end of the notice window.
        max_snapshot_bytes: largest snapshot one save may carry.
        max_template_bytes: largest template a run may register.
        max_workers: gRPC handler threads (each open save or wait holds one).
        max_concurrent_uploads: saves admitted at once, over all runs
            (blocking waiters included); past it RESOURCE_EXHAUSTED.
        admission_wait_seconds: how long a save at an admission limit (uploads or staging bytes) waits
            for room before it is refused
        max_staging_bytes: snapshot bytes held in memory at once, over all
            admitted saves; None = half the machine's memory.
        upload_timeout_seconds: an accepted save whose snapshot has not fully
            arrived this long after its accept fails with DEADLINE_EXCEEDED
            and frees its run's lane, so a stalled trainer cannot hold it.
        fsync: fsync files and directories before publishing (turn off only
            for throwaway tests).
        group_commit: small saves on a local root that finish close together
            share one sync of the root's filesystem (syncfs) instead of
            fsyncing each file and dir; each is still reported only once
            its own files and rename are durable.
        incremental_path: how an incremental save's unchanged chunks get
            into it: "auto" (per save, copied from the base or received,
            whichever the root's saves measured cheaper), "copy" (always
            from the base), "receive" (never: every byte is sent).
        tls_cert, tls_key: PEM certificate (chain) and key; with both, the
            gRPC port speaks TLS only.
        tls_client_ca: PEM CA bundle; with it, clients must present a
            certificate it signed (mutual TLS). Needs tls_cert.
        token_file: bearer tokens, one per line (`#` comments); tokens may
            also come from the environment, which this config never holds.
        insecure: allow a non-loopback host with neither TLS nor tokens.
        keep_last: retention: keep each run's newest N saves of each kind
            and delete older committed ones; None keeps everything.
        keep_every_steps: retention: also keep older saves whose step is a
            multiple of this (needs keep_last).
        shm_root: a tmpfs where the daemon offers same-host trainers a
            shared-memory segment per run (see checkpointd.transport.shm); default
            /dev/shm where it exists; None: every snapshot comes over gRPC.
        write_nice: nice value (0-19) of the threads that write saves, so
            training on the same machine comes first; 0: normal priority.
    """

    root: Path = Path("checkpoints")
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = DEFAULT_METRICS_PORT
    port_file: Path | None = None
    metrics_port_file: Path | None = None
    notice_window_seconds: float = 5.0
    grace_seconds: float = 60.0
    max_snapshot_bytes: int = 8 * GiB
    max_template_bytes: int = 16 * GiB
    max_workers: int = 64
    max_concurrent_uploads: int = 32
    admission_wait_seconds: float = 0.25
    max_staging_bytes: int | None = None
    fsync: bool = True
    group_commit: bool = True
    incremental_path: str = "auto"
    upload_timeout_seconds: float = 300.0
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    token_file: Path | None = None
    insecure: bool = False
    keep_last: int | None = None
    keep_every_steps: int | None = None
    shm_root: Path | None = None  # the CLI defaults it to DEFAULT_SHM_ROOT
    write_nice: int = 10
    s3_url: str | None = None
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_grace_seconds: float = 3600.0
    s3_read_timeout: float = 5.0  # a stalled request is cut in time for the next save to commit soon after
    lease_seconds: float = 30.0
    lease_idle_seconds: float = 120.0

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {value}")
        if not 0 <= self.grace_seconds < math.inf:  # NaN would wait forever, inf overflows the wait
            raise ValueError(f"grace_seconds must be >= 0 and finite, got {self.grace_seconds}")
        if not 0 <= self.notice_window_seconds < math.inf:
            raise ValueError(f"notice_window_seconds must be >= 0 and finite, got {self.notice_window_seconds}")
        for name in ("max_snapshot_bytes", "max_template_bytes", "max_workers", "max_concurrent_uploads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.admission_wait_seconds <= 60:  # also refuses NaN; a handler thread waits it out
            raise ValueError(f"admission_wait_seconds must be in 0..60, got {self.admission_wait_seconds}")
        if not 0 < self.upload_timeout_seconds < math.inf:  # also refuses NaN
            raise ValueError(f"upload_timeout_seconds must be > 0 and finite, got {self.upload_timeout_seconds}")
        if self.max_staging_bytes is not None and self.max_staging_bytes <= 0:
            raise ValueError(f"max_staging_bytes must be positive, got {self.max_staging_bytes}")
        RetentionPolicy(self.keep_last, self.keep_every_steps)  # validates
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.write_nice <= 19:
            raise ValueError(f"write_nice must be in 0..19, got {self.write_nice}")
        if self.s3_url is not None and not (self.s3_url.startswith("s3://") and len(self.s3_url) > len("s3://")):
            raise ValueError(f"root {self.s3_url!r} is not s3://BUCKET[/PREFIX]")
        if self.s3_url is None and (self.s3_endpoint_url is not None or self.s3_region is not None):
            raise ValueError("s3_endpoint_url and s3_region need an s3:// root")
        if not 0 <= self.s3_grace_seconds < math.inf:
            raise ValueError(f"s3_grace_seconds must be >= 0 and finite, got {self.s3_grace_seconds}")
        if not 0 < self.s3_read_timeout < math.inf:
            raise ValueError(f"s3_read_timeout must be > 0 and finite, got {self.s3_read_timeout}")
        lease.check_timing(self.lease_seconds, self.lease_idle_seconds)
        ChooserConfig(choice=self.incremental_path)  # validates

    @property
    def retention(self) -> RetentionPolicy:
        return RetentionPolicy(self.keep_last, self.keep_every_steps)

    @property
    def register_wait_seconds(self) -> float:
        """The longest a RegisterRun waits for another daemon's lease when its call has no deadline.

        Long enough for a dead daemon's lease to expire, and for a live one
        to let go of a run its dead trainer left idle (if it uses the same
        --lease-idle-seconds).
        """
        return self.lease_idle_seconds + 2 * self.lease_seconds

    @property
    def state_dir(self) -> Path:
        return self.root / ".checkpointd"
