"""The composition root and the daemon's lifecycle: start serving, report ports, drain.

`Server.start` picks the implementations behind the seams: the Store for
--root (local disk, or an object store for s3:// with the run leases a
fleet of daemons on one bucket shares), the SaveFormats (policy SavedModels and checkpoints),
the writer pool, retention and shared memory, and hands them to the save
pipeline the gRPC servicer translates onto. A new storage backend or save
kind is one module and one line here.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from checkpointd import host
from checkpointd.core.config import ServeConfig
from checkpointd.core.ports import Closing, Described, Leases, NoLeases, SaveFormat, Store, TidiesLater
from checkpointd.durable.files import check_writable_dir
from checkpointd.metrics import Metrics
from checkpointd.protocol.errors import DeadlineError, RunNotFoundError
from checkpointd.rpc import messages
from checkpointd.rpc.auth import ServerAuth, load_server_auth
from checkpointd.rpc.bind import bind_error, bind_failure, bind_quietly, bracket
from checkpointd.rpc.calls import OpenCalls
from checkpointd.rpc.servicer import CheckpointServicer, add_raw_handlers
from checkpointd.saves.budget import UploadBudget, default_staging_bytes
from checkpointd.saves.pipeline import Formats, SavePipeline
from checkpointd.saves.pool import WriterPool
from checkpointd.saves.retention import Retention
from checkpointd.saves.runs import Lanes
from checkpointd.saves.standby import Standbys
from checkpointd.storage.local import LocalStore
from checkpointd.storage.ownership import DirLock
from checkpointd.transport.shm import SharedMemory
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc as pb_grpc

_LOGGER = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CheckpointService"].full_name
# Chunks are <= 1 MiB; leave room for framing, refuse anything near gRPC's 4 MiB.
_MAX_MESSAGE_BYTES = 4 << 20
_S3_CONCURRENCY = 8  # parallel requests of one S3 transfer (S3Store's default)


class Server:
    """A running checkpointd: gRPC service, health, reflection and /metrics.

    Usage: `server = Server(config); server.start(); ...; server.stop()`.
    `port` and `metrics_port` are the ports actually bound (0 picks one).
    """

    def __init__(
        self,
        config: ServeConfig,
        *,
        registry: CollectorRegistry | None = None,
        store: Store | None = None,
        formats: Sequence[SaveFormat] | None = None,
        auth: ServerAuth | None = None,
    ) -> None:
        """Builds the daemon; nothing binds until start().

        Args:
            config: what to serve and where.
            registry: the metrics registry; a fresh one by default.
            store: where saves are committed; by default the local store on
                config.root, made in start().
            formats: the save formats; by default the policy and training
                formats, made in start().
            auth: TLS credentials and tokens; by default loaded in start() from
                the config and CHECKPOINTD_TOKENS (see checkpointd.rpc.auth).
        """
        self.config = config
        self._auth = auth
        self.registry = registry or CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.lanes = Lanes(sink=self.metrics, notice_window=config.notice_window_seconds)
        self.metrics.runs.set_function(self.lanes.count)
        self.metrics.draining.set_function(lambda: float(self.lanes.draining))
        self._store = store
        self._owns_store = store is None  # made in start(), so closed in stop()
        self._formats = formats
        self.leases: Leases = NoLeases()  # an s3:// root's S3Leases, made in start()
        self._pool: WriterPool | None = None
        self.retention: Retention | None = None
        self.shared_memory: SharedMemory | None = None
        self._standbys: Standbys | None = None  # watched trainers' standby slots (in shared memory)
        self._health = health.HealthServicer()
        self._calls = OpenCalls(SERVICE_NAME)  # ended with a status by abandon()
        self._grpc: grpc.Server | None = None
        self._http: WSGIServer | None = None
        self._stopped = threading.Event()
        self._stopping = threading.Event()  # ends the bucket's tidy
        self._tidy: threading.Thread | None = None
        self._dir_lock: DirLock | None = None
        self.port = 0
        self.metrics_port: int | None = None

    def start(self) -> None:
        """Binds, starts serving and writes the port files.

        A start that fails frees what it made (threads, shared memory, ports)
        before it raises.

        Raises:
            AuthSetupError: (a ValueError) auth was not given and loading it
                failed, or the host is exposed without auth.
            OSError: the root or the state dir is not a writable directory, or
                a port cannot be bound or its host resolved; the message says
                which, with the OS's reason.
        """
        config = self.config
        # First: an exposed bind without auth must not touch the root or load TF.
        auth = self._auth if self._auth is not None else load_server_auth(config)
        try:
            self._start(config, auth)
        except BaseException:
            self._release(grpc_grace=None, retention_timeout=1.0)
            raise

    def _start(self, config: ServeConfig, auth: ServerAuth) -> None:
        check_writable_dir(config.root, "the root (--root)")
        check_writable_dir(config.state_dir, "the daemon's state dir")
        # Before recovery: it deletes temp dirs, which are another live daemon's
        # saves in flight unless this daemon owns the dir alone.
        self._dir_lock = host.own_dir(config)
        self._pool = WriterPool(config.write_nice)
        if self._store is None:
            self._store, self.leases = _make_store(config, self._pool, self.metrics, self._busy, self._taken_over)
        fixed = self._store.recover()  # local leftovers only: quick, and before anything is staged
        if fixed:
            _LOGGER.info("recovered %d interrupted save dirs under %s", fixed, self._store.describe())
        if self._formats is None:
            from checkpointd.formats.policy import PolicyFormat
            from checkpointd.formats.training_checkpoint import TrainingFormat

            self._formats = [PolicyFormat(config.state_dir, fsync=config.fsync), TrainingFormat()]
        # A fleet's daemon touches only the runs it holds: each run's holder
        # rewrites its state files (from the manifests) at its next checkpoint.
        fleet = not isinstance(self.leases, NoLeases)
        dirs = host.checkpoint_dirs(self._store, self._formats, recover=not fleet)
        self.retention = Retention(self._store, config.retention, dirs)
        self.retention.start()
        staging_bytes = config.max_staging_bytes or default_staging_bytes()
        self.shared_memory = host.shared_memory(config.shm_root, staging_bytes)
        pipeline = SavePipeline(
            config,
            self.lanes,
            self._store,
            Formats(*self._formats),
            self._pool,
            budget=UploadBudget(config.max_concurrent_uploads, staging_bytes, config.admission_wait_seconds),
            retention=self.retention,
            shared_memory=self.shared_memory,
            phases=self.metrics,
            leases=self.leases,
            paths=(paths := host.incremental_paths(self._store, config.incremental_path)),
        )
        if self.shared_memory is not None:
            self._standbys = Standbys(pipeline, self.shared_memory.folder, messages.save_header_request, self.metrics)
        servicer = CheckpointServicer(pipeline, config.state_dir / "staging", self._standbys)
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="rpc"),
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
            interceptors=[*auth.interceptors(), self._calls],
        )
        add_raw_handlers(servicer, self._grpc)  # first: they skip a copy of each chunk
        pb_grpc.add_CheckpointServiceServicer_to_server(servicer, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._grpc,
        )
        address = f"{bracket(config.host)}:{config.port}"
        credentials = auth.credentials
        grpc_server = self._grpc
        self.port = bind_quietly(
            lambda: grpc_server.add_insecure_port(address)
            if credentials is None
            else grpc_server.add_secure_port(address, credentials)
        )
        if self.port == 0:
            raise bind_error(config.host, config.port)
        self._grpc.start()
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if config.metrics_port is not None:
            try:
                self._http, _ = start_http_server(config.metrics_port, addr=config.metrics_host, registry=self.registry)
            except OSError as e:
                raise bind_failure(
                    "/metrics", config.metrics_host, config.metrics_port, e,
                    ("--metrics-host", "--metrics-port"), "0 picks a free one, -1 turns /metrics off",
                ) from None  # fmt: skip
            self.metrics_port = self._http.server_port
        _LOGGER.info(
            "listening on port %d (root %s%s, incremental saves %s their base (--incremental-path %s), metrics %s, "
            "auth %s, shared memory %s)",
            self.port,
            self._store.describe(),
            f", {describe_leases}" if (describe_leases := _describe(self.leases)) else "",
            paths.copies.value,
            config.incremental_path,
            f"http://{config.metrics_host}:{self.metrics_port}/metrics" if self.metrics_port else "off",
            auth.describe(),
            self.shared_memory.folder if self.shared_memory is not None else "off",
        )
        host.write_port(config.port_file, self.port)
        if self.metrics_port is not None:
            host.write_port(config.metrics_port_file, self.metrics_port)
        self._start_tidy(self._store)

    def _start_tidy(self, store: Store) -> None:
        """Tidies an object store's leftovers in the background, once the daemon serves.

        Its listing of every folder can take minutes (thousands of saves, a
        slow store), and no save needs it: readers trust manifests only, and
        only leftovers older than the grace age are deleted (a peer's tidy
        runs beside live saves the same way). Done: logged, and
        checkpointd_recovery_done set to 1.
        """
        if not isinstance(store, TidiesLater):
            self.metrics.recovered.set(1)
            return

        def tidy() -> None:
            began = time.monotonic()
            fixed = store.tidy(self._stopping.is_set)
            if self._stopping.is_set():
                return
            self.metrics.recovered.set(1)
            _LOGGER.info(
                "recovery done: tidied %s in %.1fs, %d leftovers of interrupted saves deleted",
                store.describe(), time.monotonic() - began, fixed,
            )  # fmt: skip

        self._tidy = threading.Thread(target=tidy, name="tidy", daemon=True)
        self._tidy.start()

    def stop(self, grace: float | None = None) -> bool:
        """The daemon on notice, then its drain (`checkpointd.core.notice`).

        In order: new runs refused and health NOT_SERVING (load balancers send
        no new trainers; the trainers connected keep their channels); the runs
        registered here keep saving for --notice-window, or until each has sent
        its save on notice or was closed; then every save is refused, the
        accepted ones finish within the grace period, and every run lease is
        released, so the runs' next daemons take them at once.

        Args:
            grace: seconds accepted saves may take after the window; default config.grace_seconds.

        Returns:
            True if every accepted save finished within the grace period.
        """
        grace = self.config.grace_seconds if grace is None else grace
        # Refuse new runs before health says NOT_SERVING: a client that sees
        # NOT_SERVING can then rely on this daemon taking no new run.
        self.lanes.give_notice(f"daemon {socket.gethostname()} (pid {os.getpid()}, port {self.port})")
        self._health.enter_graceful_shutdown()
        noticed = time.monotonic()
        if self.config.notice_window_seconds:
            ended = self.lanes.wait_window().value
            _LOGGER.info("notice window over after %.3fs (%s): refusing every save", time.monotonic() - noticed, ended)
        self.lanes.drain()
        started = time.monotonic()
        try:
            self.lanes.flush(None, grace)
            clean = True
        except DeadlineError as exc:
            _LOGGER.error("shutdown: %s; abandoning them", exc)
            clean = False
        _LOGGER.info("drained in %.3fs", time.monotonic() - started)
        self._release(grpc_grace=1.0, retention_timeout=max(grace, 1.0))  # retention: finish queued tidying
        self._stopped.set()
        return clean

    def unfinished(self) -> list[str]:
        """The accepted and queued saves not yet durable, one description each (for logs)."""
        found = []
        for view in self.lanes.views():
            if view.in_flight is not None:
                spec = view.in_flight.spec
                found.append(f"run={view.run} kind={spec.kind.value} export_dir={spec.export_dir} step={spec.step}")
            if view.waiting:
                found.append(f"run={view.run}: {view.waiting} blocking saves queued")
        return found

    def abandon(self, why: str = "a second SIGTERM or SIGINT during its drain") -> int:
        """Tells every open call it is abandoned, and frees what outlives the process, before an exit without a drain.

        Saves in flight are cut off where they are: their temp dirs are left
        for the next daemon's recovery, and no export dir is torn. Their
        callers get UNAVAILABLE saying the daemon was stopped at once (not a
        dropped connection), within about a second.

        Args:
            why: what stopped the daemon, for the callers' message.

        Returns:
            How many open calls were told.
        """
        told = self._calls.end_all(grpc.StatusCode.UNAVAILABLE, functools.partial(_abandoned, why), timeout=1.0)
        if self._grpc is not None:
            # Sends GOAWAY and closes the connections cleanly, so the statuses
            # reach the callers before the process exits; bounded.
            self._grpc.stop(grace=0.5).wait(1.0)
        if self.shared_memory is not None:
            self.shared_memory.close()
            self.shared_memory = None
        return told

    def _release(self, *, grpc_grace: float | None, retention_timeout: float) -> None:
        """Frees what start() made, whatever it got to; each part once."""
        self._stopping.set()
        if self._tidy is not None:  # between two folders, or in a request cut by its timeout
            self._tidy.join(timeout=retention_timeout)
            self._tidy = None
        if self._grpc is not None:
            self._grpc.stop(grace=grpc_grace).wait()
            self._grpc = None
        if self.retention is not None:
            self.retention.stop(timeout=retention_timeout)
            self.retention = None
        if self._standbys is not None:  # before the leases and the folder its slots are in go
            self._standbys.close()
            self._standbys = None
        # After the drain and the queued tidying (both under the leases): every
        # run's lease is released, so other daemons take them at once.
        self.leases.close()
        self.leases = NoLeases()
        if self.shared_memory is not None:
            self.shared_memory.close()
            self.shared_memory = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._owns_store and self._store is not None:
            if isinstance(self._store, Closing):  # LocalStore's fsync threads, S3Store's transfers
                self._store.close()
        if self._dir_lock is not None:  # last: nothing of this daemon's touches the dir after it
            self._dir_lock.release()
            self._dir_lock = None

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until stop() has finished."""
        return self._stopped.wait(timeout)

    def _taken_over(self, run: str) -> None:
        """This daemon just took the run's lease: its retention first, as the last holder may not have finished it."""
        retention = self.retention
        if retention is None:
            return
        folder = self.lanes.registering_folder(run)  # taken while it registers: the folder it names
        if folder is None:
            try:
                folder = self.lanes.folder(run)
            except RunNotFoundError:
                folder = run  # not registered here: its default folder
        try:
            deleted = retention.take_over(run, folder)
        except RunNotFoundError:
            return  # nothing of it stored yet
        except Exception:  # noqa: BLE001 - its next save's retention tries again; the takeover stands
            _LOGGER.exception("retention of run=%s after taking its lease failed", run)
            return
        if deleted:
            _LOGGER.info(
                "run=%s taken over: retention deleted %d saves past its rules before its first save here", run, deleted
            )

    def _busy(self, run: str) -> bool:
        """A save of the run is in flight or queued (its lease is not idle)."""
        try:
            view = self.lanes.views(run)[0]
        except RunNotFoundError:
            return False
        return view.in_flight is not None or view.waiting > 0


def _abandoned(why: str, method: str) -> str:
    """What the caller of an abandoned call is told (UNAVAILABLE: retry elsewhere or later)."""
    if method == "Save":
        return (
            f"the daemon was stopped at once ({why}) before this save was reported durable; treat it as "
            "not saved: save again on another daemon or after the daemon restarts"
        )
    return (
        f"the daemon was stopped at once ({why}) before this {method} call finished; call again on another "
        "daemon or after the daemon restarts"
    )


def _describe(seam: object) -> str:
    """What a seam that describes itself says (the fleet's leases: `Described`); "" for one that does not."""
    return seam.describe() if isinstance(seam, Described) else ""


def _make_store(
    config: ServeConfig,
    pool: WriterPool,
    metrics: Metrics,
    busy: Callable[[str], bool],
    taken: Callable[[str], None],
) -> tuple[Store, Leases]:
    """The Store for --root and its Leases: the local disk alone, or an object store shared by a fleet for s3://.

    The bucket is checked before serving.
    """
    if config.s3_url is None:
        local = LocalStore(
            config.root, fsync=config.fsync, thread_initializer=pool.initializer, group_commit=config.group_commit
        )
        return local, NoLeases()
    # boto3 loads only for an s3:// root
    from checkpointd.storage.s3 import S3Leases, S3Store, S3Url, count_errors, count_requests, make_client

    url = S3Url.parse(config.s3_url)
    client = make_client(
        config.s3_endpoint_url, config.s3_region, 4 * _S3_CONCURRENCY, read_timeout=config.s3_read_timeout
    )
    count_requests(client, metrics.s3_request)
    count_errors(client, metrics.s3_error)
    leases = S3Leases(
        client, url.bucket, url.prefix, ttl=config.lease_seconds, idle=config.lease_idle_seconds,
        busy=busy, sink=metrics, taken=taken,
    )  # fmt: skip
    store = S3Store(
        config.s3_url,
        config.state_dir / "s3-staging",
        grace_seconds=config.s3_grace_seconds,
        max_concurrency=_S3_CONCURRENCY,
        client=client,
        fence=leases.check,
        tenure=leases.tenure,
        writer=leases.owner,
        on_upload=metrics.store_uploaded,
    )
    try:
        store.check()  # wrong credentials or a missing bucket refuse the start (OSError: exit 2)
    except BaseException:
        leases.close()  # holds nothing yet: stops its thread
        store.close()
        raise
    return store, leases
