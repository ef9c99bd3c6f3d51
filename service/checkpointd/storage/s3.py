"""The object-store Store: saves committed to S3 or an S3-compatible server (Ceph's radosgw).

Layout as on local disk, under `s3://<bucket>/<prefix>/` (`checkpointd.storage.s3_keys`).

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
   (`s3_places`) needs no HEAD.
3. Every file goes up under its final key through s3transfer (multipart
   above `part_bytes`, in parallel), each body checked by the server
   (`checkpointd.storage.s3_client.make_client`); each object's ETag is the
   one the server answered its upload with (`s3_commit.upload`). A streamed save's
   data file of at least one part has been going up since the accept, part
   by part as it filled (`stream`, `s3_parts`): its multipart upload is
   completed here, so its object too appears only after step 2. A file the
   run's previous save committed with the same bytes (a policy's graph) is
   copied server-side instead (`s3_copies`), uploaded if that source is gone.
4. The manifest, with the ETags and the writer (the daemon's lease owner
   id), is created LAST with `IfNoneMatch='*'`: a 412 means another writer
   committed there meanwhile, and the save fails.
5. If a save was replaced, objects under the new one that its manifest does
   not list (the old save's) are deleted. A save to a new place skips that
   listing; what a failed save left there has no manifest, and `recover`
   deletes it after the grace age.

A fleet of daemons shares the bucket; each run is written by the daemon
holding its lease (`checkpointd.storage.s3_lease`). The store calls the
lease's fence (`fence(run)`, no request) before step 2, right before the
manifest PUT and again after it: a daemon that lost the lease commits
nothing, and one that lost it during the PUT (paused past the margin)
withdraws its manifest and fails the save. Retention's deletes and the
training state file are fenced by the run too (they follow a commit).

Objects are overwritten in place, so a replacement that fails after step 2
leaves no save at that place (the local store keeps the old tree); saves to
new names (checkpoint steps, numbered export dirs) never meet this.

Readers trust manifests only; a save without one never counts. Delete: the
manifest first, then the objects it lists. Start-up tidying is in
`s3_recovery`, restore's download in `s3_restore`, the boto3 client
(credentials from the standard AWS chain, never flags or logs) in `s3_client`.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

from checkpointd.core.ports import CommittedSave, SavedFile, SaveMeta, Staged, WatchedSink
from checkpointd.protocol.errors import RunHeldError, RunNotFoundError, UnavailableError, describe
from checkpointd.protocol.names import RESERVED_PREFIX, TMP_PREFIX, check_export_dir, check_run_name, is_run_name
from checkpointd.storage import (
    prefix,
    s3_commit,
    s3_copies,
    s3_keys,
    s3_parts,
    s3_places,
    s3_recovery,
    s3_restore,
    save_manifest,
)
from checkpointd.storage.s3_client import (
    ETagLog,
    S3Url,
    StoreSetupError,
    create_bucket_command,
    endpoint_hint,
    error_code,
    make_client,
    small_requests,
    store_failed,
    unavailable_on_error,
)
from checkpointd.storage.s3_keys import MANIFEST, PREFIX_MANIFEST, STORE_FIELDS
from checkpointd.storage.s3_part_copy import Source, base_of

_LOGGER = logging.getLogger(__name__)


class S3Store:
    """Committed saves in an S3 bucket under a prefix. Implements `Store` and `LocalCopies`.

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
                must be before `recover` deletes it.
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
                (`s3_places`); None: every save makes it.
        """
        from boto3.s3.transfer import TransferConfig, create_transfer_manager

        self.url = S3Url.parse(url)
        self.bucket = self.url.bucket
        self.staging_root = Path(staging_root)
        self.grace_seconds = grace_seconds
        self.client = client if client is not None else make_client(endpoint_url, region, 4 * max_concurrency)
        self.transfer = create_transfer_manager(
            self.client,
            TransferConfig(
                multipart_threshold=part_bytes,
                multipart_chunksize=part_bytes,
                max_concurrency=max_concurrency,
                use_threads=True,
            ),
        )
        self._etag_log = ETagLog(self.client)
        self.small = small_requests(self.client)  # a save's small requests (s3_signed where it can)
        self._lock = threading.Lock()
        self._manifests: dict[str, tuple[str, dict[str, Any]]] = {}  # key -> (ETag, parsed)
        self._fence = fence or (lambda run: None)
        self.writer = writer
        self._on_upload = on_upload or (lambda kind, seconds, nbytes: None)
        self._folder_runs: dict[str, str] = {}  # folder -> the run last committed there (state-file fences)
        self.part_bytes = part_bytes
        self._parts_pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="s3-parts")
        self._streams: dict[str, s3_parts.PartUpload] = {}  # staging dir -> its data file's upload
        self._sources = s3_copies.Sources()  # what a run's next save may copy server-side
        self._places = s3_places.Places(self._dirs_under, tenure)  # export dirs known to hold nothing

    # Start-up.

    def check(self) -> None:
        """Proves the bucket reachable and ours, before the daemon serves.

        Raises:
            StoreSetupError: with what to fix (credentials, bucket, endpoint).
        """
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            self.client.head_bucket(Bucket=self.bucket)
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.key_base(), MaxKeys=1)
        except NoCredentialsError:
            raise StoreSetupError(
                f"no AWS credentials for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "or AWS_PROFILE with ~/.aws/credentials"
            ) from None
        except ClientError as e:
            code = error_code(e)
            if code in ("404", "NoSuchBucket"):
                raise StoreSetupError(
                    f"bucket {self.bucket!r} does not exist (--root {self.url}) at {self.client.meta.endpoint_url}; "
                    f"create it first: {create_bucket_command(self.bucket, self.client.meta.endpoint_url)}"
                ) from None
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise StoreSetupError(
                    f"access to bucket {self.bucket!r} was refused ({code}): check the AWS credentials "
                    "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the AWS config) and the bucket's policy"
                    f"{endpoint_hint(self.client.meta.endpoint_url)}"
                ) from None
            raise StoreSetupError(f"cannot use bucket {self.bucket!r}: {code or e}") from None
        except BotoCoreError as e:
            raise StoreSetupError(
                f"cannot reach the S3 server for {self.url}: {e}{endpoint_hint(self.client.meta.endpoint_url)}"
            ) from None

    def describe(self) -> str:
        return str(self.url)

    def location(self, path: PurePath) -> str:
        return f"s3://{self.bucket}/{path}"  # a save's path here is its key

    def close(self) -> None:
        self.transfer.shutdown()
        self._parts_pool.shutdown(wait=False, cancel_futures=True)

    # Keys.

    def key_base(self) -> str:
        return f"{self.url.prefix}/" if self.url.prefix else ""

    def target(self, folder: str, export_dir: str) -> PurePosixPath:
        relative = check_export_dir(export_dir)
        return PurePosixPath(self.key_base() + check_run_name(folder)) / relative

    def folder_key(self, folder: str) -> str:
        return f"{self.key_base()}{check_run_name(folder)}/"

    def _folder_of(self, key: PurePath) -> str:
        return PurePosixPath(str(key)[len(self.key_base()) :]).parts[0]

    # Writing.

    def stage(self, target: PurePath) -> Path:
        self.staging_root.mkdir(parents=True, exist_ok=True)
        staging = self.staging_root / f"{TMP_PREFIX}{target.name}-{secrets.token_hex(8)}"
        staging.mkdir()
        return staging

    def stream(self, staging: Path, target: PurePath, meta: SaveMeta, sink: WatchedSink) -> None:
        """Starts the data file's multipart upload under its final key; parts go up as they fill (`s3_parts`).

        Never raises: a save that cannot stream goes up whole at commit.
        """
        try:
            self._fence(meta.run)  # no lease, no request
            part = s3_parts.start(self.client, self.bucket, self.part_bytes, self._parts_pool, staging, target, sink)
        except Exception as e:
            _LOGGER.info("run %s: the data file of %s goes up at commit (%s)", meta.run, target, e)
            return
        if part is not None:
            with self._lock:
                self._streams[str(staging)] = part

    def discard(self, staged: Path) -> None:
        self.discard_stream(staged)  # not completed: the save failed or was given up
        shutil.rmtree(staged, ignore_errors=True)

    def commit(self, staged: Staged, target: PurePath, meta: SaveMeta) -> int:
        target = PurePosixPath(target)
        if staged.files_prefix is not None:
            staged = prefix.rename_staged_save(staged, target.name)
        place = s3_keys.keys_of(target, prefix=staged.files_prefix is not None)
        files_base, manifest_key = place.files_base, place.manifest
        self._fence(meta.run)  # a daemon without the run's lease touches nothing of it
        folder = self._folder_of(target)
        with self._lock:
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
            uploaded, listed, _ = s3_commit.upload(self, staged, files_base, manifest_key, meta)
        except Exception as e:
            if not store_failed(e):
                raise
            # The store, not the save, failed: UNAVAILABLE (the next save may
            # commit), naming where the daemon sent it and the last error.
            raise UnavailableError(
                f"run {meta.run!r}: the object store at {self.client.meta.endpoint_url} failed saving step "
                f"{meta.step} to s3://{self.bucket}/{target}: {describe(e)}"
            ) from e
        finally:
            self._on_upload(meta.kind.value, time.monotonic() - uploading, uploaded)
            # The bucket has the save (or it failed): its local copy goes either way,
            # or every save would stay on the daemon's disk until the next start.
            self.discard(staged.path)
        if replacing:  # a new place has nothing of another save to tidy (recover takes a failed one's)
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
        with self._lock:
            part = self._streams.pop(str(staged), None)
        if part is not None:
            part.abort()

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
        paginator = self.client.get_paginator("list_objects_v2")
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": key_prefix}
        if not recursive:
            kwargs["Delimiter"] = "/"
        for page in paginator.paginate(**kwargs):
            for obj in page.get("Contents", []):
                yield obj["Key"], obj

    def reading(self, what: str) -> contextlib.AbstractContextManager[None]:
        return unavailable_on_error(f"{what} in {self.url} (at {self.client.meta.endpoint_url})")

    def committed(self, folder: str, run: str | None) -> list[CommittedSave]:
        folder_key = self.folder_key(folder)
        saves = []
        with self.reading(f"listing folder {folder!r}"):
            for key, obj in self.list_objects(folder_key):
                relative = key[len(folder_key) :]
                if any(part.startswith(RESERVED_PREFIX) for part in relative.split("/")):
                    continue
                found = s3_keys.save_of(relative)
                if found is None:
                    continue
                save = self._read(key, folder_key + found[0], folder_key, obj["ETag"], is_prefix=found[1])
                if save is not None and (run is None or save.run == run):
                    saves.append(save)
        return saves

    def committed_at(self, folder: str, export_dir: str) -> CommittedSave:
        target = self.target(folder, export_dir)
        folder_key = self.folder_key(folder)
        with self.reading(f"reading {export_dir!r} of folder {folder!r}"):
            save = self._read(
                s3_keys.keys_of(target, prefix=False).manifest, str(target), folder_key, None, is_prefix=False
            )
            if save is None:
                save = self._read(
                    s3_keys.keys_of(target, prefix=True).manifest, str(target), folder_key, None, is_prefix=True
                )
        if save is None:
            raise RunNotFoundError(
                f"no committed save at {export_dir!r} in folder {folder!r} of {self.url} (no {MANIFEST})"
            )
        return save

    def manifest(self, key: str, etag: str | None) -> dict[str, Any] | None:
        """The parsed manifest at `key`, from the cache if its ETag is known and unchanged; None if absent."""
        with self._lock:
            cached = self._manifests.get(key)
        if cached is not None and etag is not None and cached[0] == etag:
            return cached[1]
        try:
            response = self.small.get_object(Bucket=self.bucket, Key=key)
        except Exception as e:
            if error_code(e) in ("NoSuchKey", "404"):
                return None
            raise
        data = response["Body"].read()
        document = save_manifest.parse_manifest(data, key.rpartition("/")[2])
        with self._lock:
            self._manifests[key] = (response["ETag"], document)
        return document

    def last_read_manifest(self, key: str) -> dict[str, Any] | None:
        """The manifest at `key` as this store last read it (a lookup or listing), with no round trip; None if never."""
        with self._lock:
            cached = self._manifests.get(key)
        return cached[1] if cached is not None else None

    def _read(
        self, manifest_key: str, save_key: str, folder_key: str, etag: str | None, *, is_prefix: bool
    ) -> CommittedSave | None:
        try:
            document = self.manifest(manifest_key, etag)
            if document is None:
                return None
            return save_manifest.committed_save(
                document,
                PurePosixPath(save_key),
                save_key[len(folder_key) :],
                prefix=is_prefix,
                store_fields=STORE_FIELDS,
            )
        except (save_manifest.ManifestError, KeyError, TypeError, ValueError) as e:
            _LOGGER.debug("not a committed save: %s (%s)", manifest_key, e)
            return None

    def keys_of(self, save: CommittedSave) -> s3_keys.SaveKeys:
        """Where a committed save's files and manifest are in the bucket."""
        return s3_keys.keys_of(save.path, prefix=save.prefix)

    def base_source(self, save: CommittedSave, data_file: str, size: int) -> Source | None:
        """The committed data object an incremental save's parts may copy (`checkpointd.saves.bases.RemoteBases`)."""
        return base_of(self, save, data_file, size)

    def local_copy(
        self, save: CommittedSave, progress: Callable[[int], None] | None = None
    ) -> contextlib.AbstractContextManager[CommittedSave]:
        return s3_restore.local_copy(self, save, progress)

    # RestoreFiles (ports.SaveFiles).

    def files_of(self, save: CommittedSave) -> list[SavedFile]:
        return s3_restore.files_of(self, save)

    def local_dir(self, save: CommittedSave) -> Path | None:
        return None

    def verified(self, save: CommittedSave, files: Sequence[SavedFile]) -> dict[str, tuple[int, int, int]]:
        return {}

    def read_ranges(self, save: CommittedSave, ranges: Sequence[tuple[str, int, int]]) -> Iterator[bytes]:
        return s3_restore.read_ranges(self, save, ranges)

    def stage_ranges(
        self, save: CommittedSave, ranges: Sequence[tuple[str, int, int]], fds: Mapping[str, int]
    ) -> Generator[tuple[str, int, int, int], None, None]:
        return s3_restore.stage_ranges(self, save, ranges, fds)

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
        except Exception as e:  # not a save any more; recover deletes them after the grace age
            _LOGGER.warning("could not delete the objects of %s: %s", save.path, e)
        return True

    def delete_keys(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            if len(batch) == 1:
                self.client.delete_object(Bucket=self.bucket, Key=batch[0])
                continue
            response = self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
            )
            errors = response.get("Errors", [])
            if errors:
                raise OSError(f"could not delete {len(errors)} objects, e.g. {errors[0].get('Key')}: {errors[0]}")
        with self._lock:
            for key in keys:
                self._manifests.pop(key, None)

    # Recovery.

    def folders(self) -> list[str]:
        found = []
        with self.reading("listing run folders"):
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key_base(), Delimiter="/"):
                for common in page.get("CommonPrefixes", []):
                    name = common["Prefix"][len(self.key_base()) :].rstrip("/")
                    if not name.startswith(RESERVED_PREFIX) and is_run_name(name):
                        found.append(name)
        return sorted(found)

    def recover(self) -> int:
        """Deletes local staging leftovers, stale multipart uploads and uncommitted objects; returns how many."""
        return s3_recovery.recover(self)

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
        with self._lock:
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
