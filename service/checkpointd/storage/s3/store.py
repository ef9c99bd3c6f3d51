"""The object-store Store: saves committed to S3 or an S3-compatible server (Ceph's radosgw).

Layout as on local disk, under `s3://<bucket>/<prefix>/` (`checkpointd.storage.s3.keys`).

Rename is not atomic in an object store, so a save is committed thus:
1. The format writes it into a private local staging dir (SaveV2 needs a
   filesystem; not fsynced: the save is durable once in the bucket, and a
   crash before that loses only an uncommitted save); the save manifest is
   computed there (every file with its size and CRC32C,
   `checkpointd.storage.save_manifest`), before any upload: run beside the
   uploads, its read pass competes with them (and with the server, on a
   shared host) for the CPU and slows the commit.
2. An older save at the same place (a HEAD of its manifest) loses its
   manifest first: it stops counting before any of its objects is replaced.
   An export dir known to hold nothing while the run's lease is held
   (`places`) needs no HEAD.
3. Every file goes up under its final key through s3transfer (multipart
   above `part_bytes`, in parallel), each body checked by the server
   (`checkpointd.storage.s3.client.make_client`); each object's ETag is the
   one the server answered its upload with (`commit.upload`). A streamed save's
   data file of at least one part has been going up since the accept, part
   by part as it filled (`stream`, `parts`): its multipart upload is
   completed here, so its object too appears only after step 2. A file the
   run's previous save committed with the same bytes (a policy's graph) is
   copied server-side instead (`copies`), uploaded if that source is gone.
4. The manifest, with the ETags and the writer (the daemon's lease owner
   id), is created LAST with `IfNoneMatch='*'`: a 412 means another writer
   committed there meanwhile, and the save fails.
5. If a save was replaced, objects under the new one that its manifest does
   not list (the old save's) are deleted. A save to a new place skips that
   listing; what a failed save left there has no manifest, and `tidy`
   deletes it after the grace age.

A fleet of daemons shares the bucket; each run is written by the daemon
holding its lease (`checkpointd.storage.s3.lease`). The store calls the
lease's fence (`fence(run)`, no request) before step 2, before every write
request of steps 3 and 4 (each attempt: `save_requests`, which also
stops retries at the save's deadline), right before the
manifest PUT and again after it: a daemon that lost the lease commits
nothing, and one that lost it during the PUT (paused past the margin)
withdraws its manifest and fails the save. Retention's deletes and the
training state file are fenced by the run too (they follow a commit).

Objects are overwritten in place, so a replacement that fails after step 2
leaves no save at that place (the local store keeps the old tree); saves to
new names (checkpoint steps, numbered export dirs) never meet this.

Readers trust manifests only; a save without one never counts. Delete: the
manifest first, then the objects it lists. Listing the committed saves is in
`catalog`, start-up tidying in `recovery`, restore's download in `restore`, the boto3 client
(credentials from the standard AWS chain, never flags or logs) in `client`.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

from checkpointd.core.ports import CommittedSave, SavedFile, SaveMeta, Staged, WatchedSink
from checkpointd.protocol.errors import RunHeldError, UnavailableError, describe
from checkpointd.protocol.names import TMP_PREFIX, check_export_dir, check_run_name
from checkpointd.storage import prefix
from checkpointd.storage.s3 import catalog, commit, parts, recovery, restore
from checkpointd.storage.s3.bucket import Bucket
from checkpointd.storage.s3.client import (
    ETagLog,
    S3Url,
    check_bucket,
    error_code,
    make_client,
    small_requests,
    store_failed,
)
from checkpointd.storage.s3.keys import MANIFEST, PREFIX_MANIFEST, SaveKeys, keys_of
from checkpointd.storage.s3.part_copy import Source
from checkpointd.storage.s3.places import Places
from checkpointd.storage.s3.save_requests import SaveDeadlineError, SaveRequests

_LOGGER = logging.getLogger(__name__)


class S3Store:
    """Committed saves in an S3 bucket under a prefix.

    Implements `Store` and the capabilities `StreamingStore`, `RemoteBases`,
    `LocalCopies`, `SaveFiles`, `StagesFiles`, `TidiesLater`, `BoundedRequests` and `Closing` (`checkpointd.core.ports`).

    Thread-safe: boto3 clients and the transfer manager are; the manifest
    cache has a lock.
    """

    def __init__(
        self,
        url: str,
        staging_root: Path,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        grace_seconds: float = 3600.0,
        part_bytes: int = 16 << 20,
        max_concurrency: int = 8,
        client: Any = None,
        fence: Callable[[str], None] | None = None,
        writer: str | None = None,
        on_upload: Callable[[str, float, int], None] | None = None,
        tenure: Callable[[str], object | None] | None = None,
    ) -> None:
        """Makes the store; nothing is sent until `check` or a save.

        Args:
            url: `s3://BUCKET[/PREFIX]`.
            staging_root: a local dir for staging and restore copies.
            endpoint_url: another S3 server than AWS's (e.g. radosgw's).
            region: the bucket's region; default from the AWS config.
            grace_seconds: how old an uncommitted object or multipart upload
                must be before `tidy` deletes it.
            part_bytes: multipart threshold and part size.
            max_concurrency: parallel requests of one transfer manager.
            client: a boto3 S3 client (the leases' too); by default one is made.
            fence: raises RunHeldError unless this daemon holds the run's
                lease (`Leases.check`); None: no fleet, nothing to check.
            writer: this daemon's lease owner id, recorded in each manifest.
            on_upload: called per commit with (kind, seconds, bytes) of its
                upload to the bucket (the files sent, not those copied
                server-side, and the manifest; 0 bytes if it failed).
            tenure: the run's lease tenure (`S3Leases.tenure`): with it, a
                save into an export dir known empty skips step 2's HEAD
                (`places`); None: every save makes it.
        """
        from boto3.s3.transfer import TransferConfig, create_transfer_manager

        self.url = S3Url.parse(url)
        self.bucket = self.url.bucket
        self.staging_root = Path(staging_root)
        self.grace_seconds = grace_seconds
        self.client = client if client is not None else make_client(endpoint_url, region, 4 * max_concurrency)
        self.part_bytes = part_bytes
        self.writer = writer
        self.shared = Bucket(
            self.url,
            self.staging_root,
            self.client,
            create_transfer_manager(
                self.client,
                TransferConfig(
                    multipart_threshold=part_bytes,
                    multipart_chunksize=part_bytes,
                    max_concurrency=max_concurrency,
                    use_threads=True,
                ),
            ),
            small_requests(self.client),
            part_bytes,
            ThreadPoolExecutor(max_concurrency, thread_name_prefix="s3-parts"),
            fence or (lambda run: None),
            writer,
            ETagLog(self.client),
        )
        self.transfer, self.small = self.shared.transfer, self.shared.small
        self._fence = self.shared.fence
        # Each request of a save, each retry too: writes under the run's lease, none past the save's deadline.
        self._requests = SaveRequests(self.client, self.bucket, fence or (lambda run: None))
        # An attempt under way when retries stop may take this long still (--s3-read-timeout).
        self._read_timeout = float(getattr(self.client.meta.config, "read_timeout", 0) or 0)
        self._on_upload = on_upload or (lambda kind, seconds, nbytes: None)
        self._folder_runs: dict[str, str] = {}  # folder -> the run last committed there (state-file fences)
        self._places = Places(self._dirs_under, tenure)  # export dirs known to hold nothing

    # Start-up.

    def check(self) -> None:
        """Proves the bucket reachable and ours, before the daemon serves.

        Raises:
            StoreSetupError: with what to fix (credentials, bucket, endpoint).
        """
        check_bucket(self.client, self.url, self.key_base())

    def describe(self) -> str:
        return str(self.url)

    def location(self, path: PurePath) -> str:
        return f"s3://{self.bucket}/{path}"  # a save's path here is its key

    def close(self) -> None:
        self.transfer.shutdown()
        self.shared.parts_pool.shutdown(wait=False, cancel_futures=True)

    # Keys.

    def key_base(self) -> str:
        return self.shared.key_base()

    def target(self, folder: str, export_dir: str) -> PurePosixPath:
        relative = check_export_dir(export_dir)
        return PurePosixPath(self.key_base() + check_run_name(folder)) / relative

    def folder_key(self, folder: str) -> str:
        return self.shared.folder_key(folder)

    def _folder_of(self, key: PurePath) -> str:
        return PurePosixPath(str(key)[len(self.key_base()) :]).parts[0]

    # Writing.

    def stage(self, target: PurePath) -> Path:
        self.staging_root.mkdir(parents=True, exist_ok=True)
        staging = self.staging_root / f"{TMP_PREFIX}{target.name}-{secrets.token_hex(8)}"
        staging.mkdir()
        return staging

    def stream(self, staging: Path, target: PurePath, meta: SaveMeta, sink: WatchedSink) -> None:
        """Starts the data file's multipart upload under its final key; parts go up as they fill (`parts`).

        Never raises: a save that cannot stream goes up whole at commit.
        """
        try:
            self._fence(meta.run)  # no lease, no request
            self._writing(staging, target, meta)
            part = parts.start(self.client, self.bucket, self.part_bytes, self.shared.parts_pool, staging, target, sink)
        except Exception as e:
            _LOGGER.info("run %s: the data file of %s goes up at commit (%s)", meta.run, target, e)
            return
        if part is not None:
            with self.shared.lock:
                self.shared.streams[str(staging)] = part

    def discard(self, staged: Path) -> None:
        self.discard_stream(staged)  # not completed: the save failed or was given up
        self._requests.done(str(staged))
        shutil.rmtree(staged, ignore_errors=True)

    def bounded(self, deadline: float | None) -> contextlib.AbstractContextManager[None]:
        """This thread's requests inside the block stop a read timeout before `deadline` (UNAVAILABLE then)."""
        return self._requests.bounded(deadline - self._read_timeout if deadline is not None else None)

    def _writing(self, staging: Path, target: PurePath, meta: SaveMeta) -> None:
        """From now until `discard`, every request under `target` is fenced by the run's lease and the save's deadline.

        Retries stop a read timeout before the save's deadline, so the attempt
        then under way ends, and the failure reaches the caller, within it.
        """
        deadline = meta.deadline - self._read_timeout if meta.deadline is not None else None
        self._requests.writing(str(staging), str(target), meta.run, deadline)

    def commit(self, staged: Staged, target: PurePath, meta: SaveMeta) -> int:
        target = PurePosixPath(target)
        if staged.files_prefix is not None:
            staged = prefix.rename_staged_save(staged, target.name)
        place = keys_of(target, prefix=staged.files_prefix is not None)
        files_base, manifest_key = place.files_base, place.manifest
        self._fence(meta.run)  # a daemon without the run's lease touches nothing of it
        self._writing(staged.path, target, meta)
        folder = self._folder_of(target)
        with self.shared.lock:
            self._folder_runs[folder] = meta.run
        uploading, uploaded, replacing = time.monotonic(), 0, False
        try:
            empty = (
                staged.files_prefix is None
                and target.parent.name != ""  # a save's dir is always inside its run's folder
                and self._places.claim(f"{target.parent}/", meta.run, target.name)
            )
            if not empty:
                replacing = self._unpublish(manifest_key)  # an old save here stops counting first
            uploaded, listed, _ = commit.upload(self.shared, staged, files_base, manifest_key, meta)
        except Exception as e:
            if not (store_failed(e) or isinstance(e, SaveDeadlineError)):
                raise
            # The store, not the save, failed (or kept failing until the save's
            # deadline): UNAVAILABLE (the next save may commit), naming where the
            # daemon sent it and the last error.
            raise UnavailableError(
                f"run {meta.run!r}: the object store at {self.client.meta.endpoint_url} failed saving step "
                f"{meta.step} to s3://{self.bucket}/{target}: {describe(e)}"
            ) from e
        finally:
            self._on_upload(meta.kind.value, time.monotonic() - uploading, uploaded)
            # The bucket has the save (or it failed): its local copy goes either way,
            # or every save would stay on the daemon's disk until the next start.
            self.discard(staged.path)
        if replacing:  # a new place has nothing of another save to tidy (tidy takes a failed one's)
            self._drop_unlisted(files_base, target.name if staged.files_prefix is not None else None, listed)
        return staged.bytes_written  # the listed files' bytes, as verify counts them (not the manifest's)

    def _unpublish(self, manifest_key: str) -> bool:
        """Deletes the manifest of a save at `manifest_key`'s place, if there is one; True if there was."""
        try:
            self.small.head_object(Bucket=self.bucket, Key=manifest_key)
        except Exception as e:
            if error_code(e) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        self.delete_keys([manifest_key])
        return True

    def _dirs_under(self, dir_key: str) -> set[str] | None:
        """The names of the dirs right under `dir_key` (one request); None if they are more than one page."""
        answer = self.client.list_objects_v2(Bucket=self.bucket, Prefix=dir_key, Delimiter="/")
        if answer.get("IsTruncated"):
            return None
        return {str(p["Prefix"])[len(dir_key) :].rstrip("/") for p in answer.get("CommonPrefixes", [])}

    def discard_stream(self, staged: Path) -> None:
        """Aborts the streamed upload of a staged save, if it has one."""
        self.shared.discard_stream(staged)

    def _drop_unlisted(self, files_base: str, prefix_name: str | None, listed: set[str]) -> None:
        """Deletes what a replaced save left under the new one's names (best effort)."""
        try:
            if prefix_name is None:
                keys = [k for k, _ in self.list_objects(files_base) if k[len(files_base) :] not in listed | {MANIFEST}]
            else:
                keys = [
                    k
                    for k, _ in self.list_objects(files_base + prefix_name + ".", recursive=False)
                    if k[len(files_base) :] not in listed and not k.endswith(PREFIX_MANIFEST)
                ]
            self.delete_keys(keys)
        except Exception as e:  # the save is committed; leftovers are only unlisted objects
            _LOGGER.warning("could not delete a replaced save's leftovers under %s: %s", files_base, e)

    # Reading.

    def list_objects(self, key_prefix: str, *, recursive: bool = True) -> Iterator[tuple[str, dict[str, Any]]]:
        """(key, object) of every object under `key_prefix`, without crossing '/' unless recursive."""
        return self.shared.list_objects(key_prefix, recursive=recursive)

    def reading(self, what: str) -> contextlib.AbstractContextManager[None]:
        return self.shared.reading(what)

    def committed(self, folder: str, run: str | None) -> list[CommittedSave]:
        return catalog.committed(self.shared, folder, run)

    def committed_at(self, folder: str, export_dir: str) -> CommittedSave:
        return catalog.committed_at(self.shared, self.target(folder, export_dir), folder, export_dir)

    def manifest(self, key: str, etag: str | None) -> dict[str, Any] | None:
        """The parsed manifest at `key`, from the cache if its ETag is known and unchanged; None if absent."""
        return self.shared.manifest(key, etag)

    def last_read_manifest(self, key: str) -> dict[str, Any] | None:
        """The manifest at `key` as this store last read it (a lookup or listing), with no round trip; None if never."""
        return self.shared.last_read_manifest(key)

    def keys_of(self, save: CommittedSave) -> SaveKeys:
        """Where a committed save's files and manifest are in the bucket."""
        return self.shared.keys_of(save)

    def base_source(self, save: CommittedSave, data_file: str, size: int) -> Source | None:
        """The committed data object (`save`'s path + `data_file`, `size` bytes) a new save's parts may copy, or None."""
        return catalog.base_source(self.shared, save, data_file, size)

    def local_copy(
        self, save: CommittedSave, progress: Callable[[int], None] | None = None
    ) -> contextlib.AbstractContextManager[CommittedSave]:
        return restore.local_copy(self.shared, save, progress)

    # RestoreFiles (ports.SaveFiles).

    def files_of(self, save: CommittedSave) -> list[SavedFile]:
        return restore.files_of(self.shared, save)

    def local_dir(self, save: CommittedSave) -> Path | None:
        return None

    def verified(self, save: CommittedSave, files: Sequence[SavedFile]) -> dict[str, tuple[int, int, int]]:
        return {}

    def read_ranges(self, save: CommittedSave, ranges: Sequence[tuple[str, int, int]]) -> Iterator[bytes]:
        return restore.read_ranges(self.shared, save, ranges)

    def stage_ranges(
        self, save: CommittedSave, ranges: Sequence[tuple[str, int, int]], fds: Mapping[str, int]
    ) -> Generator[tuple[str, int, int, int], None, None]:
        return restore.stage_ranges(self.shared, save, ranges, fds)

    # Deleting.

    def delete(self, save: CommittedSave) -> bool:
        place = self.keys_of(save)
        files_base, manifest_key = place.files_base, place.manifest
        try:
            self._fence(save.run)  # only the run's writer deletes its saves
        except RunHeldError as e:
            _LOGGER.info("not deleting %s: %s", save.path, e)
            return False
        try:
            document = self.manifest(manifest_key, None)
            listed = [e.path for e in document["files"]] if document is not None else []
            self.delete_keys([manifest_key])  # the save stops counting first
        except Exception as e:
            _LOGGER.warning("could not delete %s from %s: %s", save.path, self.url, e)
            return False
        name = PurePosixPath(save.path).name
        keys = [files_base + rel for rel in listed if not save.prefix or rel.startswith(name + ".")]
        try:
            self.delete_keys(keys)
        except Exception as e:  # not a save any more; tidy deletes them after the grace age
            _LOGGER.warning("could not delete the objects of %s: %s", save.path, e)
        return True

    def delete_keys(self, keys: list[str]) -> None:
        self.shared.delete_keys(keys)

    # Recovery.

    def folders(self) -> list[str]:
        return self.shared.folders()

    def recover(self) -> int:
        """Deletes local staging leftovers (before the daemon serves); returns how many. The bucket: `tidy`."""
        return recovery.remove_staging(self.shared)

    def tidy(self, stopping: Callable[[], bool]) -> int:
        """Aborts stale multipart uploads and deletes uncommitted objects past the grace age; returns how many."""
        return recovery.tidy(self.shared, self.grace_seconds, stopping)

    # State files beside the saves.

    def read_file(self, path: PurePath) -> bytes | None:
        with self.reading(f"reading {path}"):
            try:
                return bytes(self.client.get_object(Bucket=self.bucket, Key=str(path))["Body"].read())
            except Exception as e:
                if error_code(e) in ("NoSuchKey", "404"):
                    return None
                raise

    def write_file(self, path: PurePath, data: bytes) -> None:
        """Replaces a state file beside the saves, under the lease of the run(s) whose saves it names.

        Raises:
            RunHeldError: this daemon does not hold the lease of the folder's run.
            UnavailableError: the object store failed (connection, timeout, 5xx, throttled).
            OSError: it could not be written.
        """
        folder = self._folder_of(path)
        with self.shared.lock:
            run = self._folder_runs.get(folder)
        runs = {run} if run is not None else {s.run for s in self.committed(folder, None)}
        for name in sorted(runs):
            self._fence(name)
        # One PUT replaces an object atomically: readers see the old or the new one.
        try:
            self.client.put_object(Bucket=self.bucket, Key=str(path), Body=data)
        except Exception as e:
            if store_failed(e):  # the store, not the request: UNAVAILABLE, as a save's commit says it
                raise UnavailableError(
                    f"the object store at {self.client.meta.endpoint_url} failed writing s3://{self.bucket}/{path}: "
                    f"{describe(e)}"
                ) from e
            raise OSError(f"could not write {path} to {self.url}: {e}") from e
