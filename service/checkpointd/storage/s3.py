"""The object-store Store: saves committed to S3 or an S3-compatible server (Ceph's radosgw).

Layout, as on local disk: `s3://<bucket>/<prefix>/<folder>/<export_dir>/<files>`
for a save that is a dir of its own, `<folder>/<dir>/<name>.<suffix>` for a
training checkpoint's prefix beside the others of its dir, and the dir's
`checkpoint` state file there too.

Rename is not atomic in an object store, so a save is committed thus:
1. The format writes it into a private local staging dir (SaveV2 needs a
   filesystem; not fsynced: the save is durable once in the bucket, and a
   crash before that loses only an uncommitted save); the save manifest is
   computed there (every file with its size and CRC32C,
   `checkpointd.storage.save_manifest`), before any upload: run beside the
   uploads, on 2 cores that also serve radosgw, the pass slowed a large
   save's commit (interleaved A/B, 400 MB: 1.79 s before, 2.79 s beside).
2. An older save at the same place (a HEAD of its manifest) loses its
   manifest first: it stops counting before any of its objects is replaced.
3. Every file goes up under its final key through s3transfer (multipart
   above `part_bytes`, parts and files in parallel), each request's body
   checked by the server: its SHA-256 signed by SigV4 over HTTP, a
   Content-MD5 over HTTPS (`make_client`; radosgw neither stores nor checks
   a CRC32C). Each object's ETag is the one the server answered its upload with, read
   back with a HEAD (and its size checked) only where the answer had none.
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
manifest first, then the objects it lists. `recover` (at start) aborts
multipart uploads under the prefix and deletes objects no manifest lists,
both only older than `grace_seconds` (a peer's save in progress is younger)
and only of names this daemon writes. Restore reads a local copy
(`local_copy`), checked against the manifest's sizes and CRC32Cs.

Credentials come from the standard AWS chain (environment, config files,
instance roles), never from flags; they are never logged. boto3 is imported
when the store is made, so the rest of the daemon does not need it.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

from checkpointd.core.ports import CommittedSave, SaveMeta, Staged
from checkpointd.protocol.errors import ChecksumError, RunHeldError, RunNotFoundError, UnavailableError
from checkpointd.protocol.names import RESERVED_PREFIX, TMP_PREFIX, check_export_dir, check_run_name
from checkpointd.storage import prefix, save_manifest

_LOGGER = logging.getLogger(__name__)

MANIFEST = save_manifest.MANIFEST_NAME
PREFIX_MANIFEST = save_manifest.PREFIX_MANIFEST_SUFFIX
_ETAGS = "s3_etags"  # the manifest's extra field: path -> ETag
_WRITER = "writer"  # the manifest's extra field: the owner id of the daemon that committed it
_STORE_FIELDS = frozenset({_ETAGS, _WRITER})  # manifest fields this store adds, not the format's
# What `recover` may delete: the files checkpointd writes, relative to a save dir...
_SAVE_DIR_FILE = re.compile(r"^(saved_model\.pb|fingerprint\.pb|policy_specs\.pbtxt|assets/.+|variables/.+)$")
# ... and a training checkpoint's files beside others.
_PREFIX_FILE = re.compile(r"^(?P<name>.+)\.(index|data-\d{5}-of-\d{5})$")


class StoreSetupError(OSError):
    """The bucket cannot be used: no credentials, refused, missing or unreachable."""


@dataclass(frozen=True)
class S3Url:
    """`s3://bucket/prefix`, parsed."""

    bucket: str
    prefix: str  # no leading or trailing '/'; may be empty

    @classmethod
    def parse(cls, url: str) -> S3Url:
        """Raises ValueError unless `url` is `s3://BUCKET[/PREFIX]`."""
        if not url.startswith("s3://"):
            raise ValueError(f"{url!r} is not an s3:// URL")
        bucket, _, rest = url[len("s3://") :].partition("/")
        if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
            raise ValueError(f"{url!r} does not name a valid bucket (s3://BUCKET/PREFIX)")
        key_prefix = rest.strip("/")
        if any(part in ("", ".", "..") for part in key_prefix.split("/")) and key_prefix:
            raise ValueError(f"{url!r} has an empty, '.' or '..' component in its prefix")
        return cls(bucket, key_prefix)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def make_client(endpoint_url: str | None, region: str | None, max_connections: int = 32) -> Any:
    """An S3 client that works on AWS and on radosgw; every upload's body is checked by the server.

    Over HTTPS, SigV4 sends UNSIGNED-PAYLOAD, so each PutObject/UploadPart
    carries a Content-MD5 (`_content_md5`) that the server verifies. Over
    plain HTTP, SigV4 signs the body's SHA-256 and the server refuses a body
    that does not match it, so an MD5 pass would check the same bytes twice.
    """
    import boto3
    from botocore.config import Config

    # Resolved here, not left to boto3, so AWS_ENDPOINT_URL also picks path-style
    # addressing and the body checks of a non-AWS server below.
    endpoint_url = resolve_endpoint(endpoint_url)
    config = Config(
        region_name=region,
        # rgw rejects botocore's default trailing checksums over HTTPS (411)
        # and ignores CRC32C anyway: checksum only where an API requires it,
        # and let the server check each body another way (see the docstring).
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        retries={"max_attempts": 4, "mode": "standard"},
        connect_timeout=5,
        read_timeout=60,
        max_pool_connections=max_connections,
        s3={"addressing_style": "path" if endpoint_url else "auto"},
    )
    client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
    if not body_is_signed(endpoint_url):
        for operation in ("PutObject", "UploadPart"):
            client.meta.events.register(f"before-call.s3.{operation}", _content_md5)
    return client


def _is_aws(endpoint_url: str | None) -> bool:
    return endpoint_url is None or endpoint_url.rstrip("/").endswith(".amazonaws.com")


def _endpoint_hint(endpoint_url: str | None) -> str:
    """For a failure at AWS's own endpoint: the flag (or variable) that names another S3 server."""
    if not _is_aws(endpoint_url):
        return ""
    return (
        f"; this went to AWS ({endpoint_url}): for another S3 server (radosgw, MinIO...) give "
        "--s3-endpoint-url URL or set AWS_ENDPOINT_URL"
    )


def _create_bucket_command(bucket: str, endpoint_url: str | None) -> str:
    """A command that creates `bucket` at the endpoint: the AWS CLI's, and one with boto3 (checkpointd's)."""
    aws = f"aws s3 mb s3://{bucket}" + ("" if _is_aws(endpoint_url) else f" --endpoint-url {endpoint_url}")
    endpoint = "" if _is_aws(endpoint_url) else f"endpoint_url={endpoint_url!r}"
    python = f"python -c \"import boto3; boto3.client('s3', {endpoint}).create_bucket(Bucket={bucket!r})\""
    return f"{aws} (or, without the AWS CLI: {python})".replace("('s3', )", "('s3')")


def resolve_endpoint(endpoint_url: str | None) -> str | None:
    """The S3 server to use: the flag's, else AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (as boto3 reads them), else AWS's."""
    return endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def body_is_signed(endpoint_url: str | None) -> bool:
    """True where SigV4 signs each request body's SHA-256 (plain HTTP); AWS's default endpoint is HTTPS."""
    return endpoint_url is not None and endpoint_url.lower().startswith("http://")


def _content_md5(params: dict[str, Any], **_: Any) -> None:
    """Adds Content-MD5 to an upload request: the server refuses a body that does not match."""
    headers = params["headers"]
    body = params.get("body")
    if body is None or "Content-MD5" in headers:
        return
    md5 = hashlib.md5(usedforsecurity=False)
    if isinstance(body, (bytes, bytearray, memoryview)):
        md5.update(body)
    else:  # s3transfer's file chunk: read it through, then rewind for the send
        start = body.tell()
        for block in iter(lambda: body.read(1 << 20), b""):
            md5.update(block)
        body.seek(start)
    headers["Content-MD5"] = base64.b64encode(md5.digest()).decode("ascii")


def _code(e: BaseException) -> str:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


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
                upload to the bucket (files and manifest; 0 bytes if it failed).
        """
        from boto3.s3.transfer import TransferConfig, create_transfer_manager

        self.url = S3Url.parse(url)
        self.bucket = self.url.bucket
        self.staging_root = Path(staging_root)
        self.grace_seconds = grace_seconds
        self.client = client if client is not None else make_client(endpoint_url, region, 4 * max_concurrency)
        self._transfer = create_transfer_manager(
            self.client,
            TransferConfig(
                multipart_threshold=part_bytes,
                multipart_chunksize=part_bytes,
                max_concurrency=max_concurrency,
                use_threads=True,
            ),
        )
        self._etag_log = _ETagLog(self.client)
        self._lock = threading.Lock()
        self._manifests: dict[str, tuple[str, dict[str, Any]]] = {}  # key -> (ETag, parsed)
        self._fence = fence or (lambda run: None)
        self.writer = writer
        self._on_upload = on_upload or (lambda kind, seconds, nbytes: None)
        self._folder_runs: dict[str, str] = {}  # folder -> the run last committed there (state-file fences)

    # Start-up.

    def check(self) -> None:
        """Proves the bucket reachable and ours, before the daemon serves.

        Raises:
            StoreSetupError: with what to fix (credentials, bucket, endpoint).
        """
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            self.client.head_bucket(Bucket=self.bucket)
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._base(), MaxKeys=1)
        except NoCredentialsError:
            raise StoreSetupError(
                f"no AWS credentials for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "or AWS_PROFILE with ~/.aws/credentials"
            ) from None
        except ClientError as e:
            code = _code(e)
            if code in ("404", "NoSuchBucket"):
                raise StoreSetupError(
                    f"bucket {self.bucket!r} does not exist (--root {self.url}) at {self.client.meta.endpoint_url}; "
                    f"create it first: {_create_bucket_command(self.bucket, self.client.meta.endpoint_url)}"
                ) from None
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise StoreSetupError(
                    f"access to bucket {self.bucket!r} was refused ({code}): check the AWS credentials "
                    "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the AWS config) and the bucket's policy"
                    f"{_endpoint_hint(self.client.meta.endpoint_url)}"
                ) from None
            raise StoreSetupError(f"cannot use bucket {self.bucket!r}: {code or e}") from None
        except BotoCoreError as e:
            raise StoreSetupError(
                f"cannot reach the S3 server for {self.url}: {e}{_endpoint_hint(self.client.meta.endpoint_url)}"
            ) from None

    def describe(self) -> str:
        return str(self.url)

    def location(self, path: PurePath) -> str:
        return f"s3://{self.bucket}/{path}"  # a save's path here is its key

    def close(self) -> None:
        self._transfer.shutdown()

    # Keys.

    def _base(self) -> str:
        return f"{self.url.prefix}/" if self.url.prefix else ""

    def target(self, folder: str, export_dir: str) -> PurePosixPath:
        relative = check_export_dir(export_dir)
        return PurePosixPath(self._base() + check_run_name(folder)) / relative

    def _folder_key(self, folder: str) -> str:
        return f"{self._base()}{check_run_name(folder)}/"

    def _folder_of(self, key: PurePath) -> str:
        return PurePosixPath(str(key)[len(self._base()) :]).parts[0]

    # Writing.

    def stage(self, target: PurePath) -> Path:
        self.staging_root.mkdir(parents=True, exist_ok=True)
        staging = self.staging_root / f"{TMP_PREFIX}{target.name}-{secrets.token_hex(8)}"
        staging.mkdir()
        return staging

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def commit(self, staged: Staged, target: PurePath, meta: SaveMeta) -> int:
        target = PurePosixPath(target)
        if staged.files_prefix is not None:
            prefix.rename_staged(staged.path, staged.files_prefix, target.name)
            files_base, manifest_key = f"{target.parent}/", f"{target}{PREFIX_MANIFEST}"
        else:
            files_base, manifest_key = f"{target}/", f"{target}/{MANIFEST}"
        self._fence(meta.run)  # a daemon without the run's lease touches nothing of it
        with self._lock:
            self._folder_runs[self._folder_of(target)] = meta.run
        uploading, uploaded, replacing = time.monotonic(), 0, False
        try:
            replacing = self._unpublish(manifest_key)  # an old save here stops counting first
            uploaded, listed, _ = self._upload(staged, files_base, manifest_key, meta)
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
            self.client.head_object(Bucket=self.bucket, Key=manifest_key)
        except Exception as e:
            if _code(e) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        self._delete_keys([manifest_key])
        return True

    def _upload(self, staged: Staged, files_base: str, manifest_key: str, meta: SaveMeta) -> tuple[int, set[str], int]:
        """Uploads a save's files, then its manifest (fenced); returns (bytes sent, files listed, manifest bytes).

        Every file goes up at once. Each object's ETag is the one its PutObject or
        CompleteMultipartUpload answered (`_ETagLog`): the server took the
        whole body, checked against its signed SHA-256 or Content-MD5, so no
        HEAD per object is needed to learn it. Only an object whose answer
        had no ETag (radosgw's CompleteMultipartUpload) is read back with a
        HEAD, its size checked too.
        """
        files = _staged_files(staged.path)
        keys = {files_base + rel: rel for rel in files}
        futures = []
        manifest_bytes = save_manifest.write_staged_manifest(staged, meta)
        with self._etag_log.awaiting(self.bucket, keys) as etags:
            try:
                futures = [self._transfer.upload(str(staged.path / rel), self.bucket, key) for key, rel in keys.items()]
                for future in futures:
                    future.result()  # raises the first failure; the manifest is not written
            except BaseException:
                for future in futures:  # none may still read the staged files once they are discarded
                    future.cancel()
                for future in futures:
                    with contextlib.suppress(BaseException):
                        future.result()
                raise
        document = json.loads((staged.path / MANIFEST).read_bytes())
        listed = {entry["path"] for entry in document["files"]}
        if listed != set(files):
            raise OSError(f"the staged files of {files_base} changed during the upload ({sorted(listed ^ set(files))})")
        sizes = {entry["path"]: int(entry["size"]) for entry in document["files"]}
        for key, rel in keys.items():
            if key not in etags:  # radosgw answers a CompleteMultipartUpload with an empty ETag
                head = self.client.head_object(Bucket=self.bucket, Key=key)
                if head["ContentLength"] != sizes[rel]:
                    raise ChecksumError(
                        f"{key} has {head['ContentLength']} bytes in the bucket, {sizes[rel]} were sent"
                    )
                etags[key] = head["ETag"].strip('"')
        document[_ETAGS] = {rel: etags[key] for key, rel in keys.items()}
        if self.writer is not None:
            document[_WRITER] = self.writer
        body = (json.dumps(document, indent=1) + "\n").encode("utf-8")
        self._fence(meta.run)  # the lease, checked last before the commit
        try:
            self.client.put_object(Bucket=self.bucket, Key=manifest_key, Body=body, IfNoneMatch="*")
        except Exception as e:
            if _code(e) in ("PreconditionFailed", "412"):
                raise OSError(f"another writer committed {manifest_key} meanwhile; this save is not committed") from e
            raise
        try:
            self._fence(meta.run)  # lost during the PUT (a pause past the margin): withdraw it
        except Exception:
            _LOGGER.warning("run %s: the lease was lost while %s was written; withdrawing it", meta.run, manifest_key)
            self._delete_keys([manifest_key])
            raise
        return sum(int(e["size"]) for e in document["files"]) + len(body), listed, manifest_bytes

    def _drop_unlisted(self, files_base: str, prefix_name: str | None, listed: set[str]) -> None:
        """Deletes what a replaced save left under the new one's names (best effort)."""
        try:
            if prefix_name is None:
                keys = [k for k, _ in self._list(files_base) if k[len(files_base) :] not in listed | {MANIFEST}]
            else:
                keys = [
                    k
                    for k, _ in self._list(files_base + prefix_name + ".", recursive=False)
                    if k[len(files_base) :] not in listed and not k.endswith(PREFIX_MANIFEST)
                ]
            self._delete_keys(keys)
        except Exception as e:  # the save is committed; leftovers are only unlisted objects
            _LOGGER.warning("could not delete a replaced save's leftovers under %s: %s", files_base, e)

    # Reading.

    def _list(self, key_prefix: str, *, recursive: bool = True) -> Iterator[tuple[str, dict[str, Any]]]:
        """(key, object) of every object under `key_prefix`, without crossing '/' unless recursive."""
        paginator = self.client.get_paginator("list_objects_v2")
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": key_prefix}
        if not recursive:
            kwargs["Delimiter"] = "/"
        for page in paginator.paginate(**kwargs):
            for obj in page.get("Contents", []):
                yield obj["Key"], obj

    def _reading(self, what: str) -> contextlib.AbstractContextManager[None]:
        return _unavailable_on_error(f"{what} in {self.url}")

    def committed(self, folder: str, run: str | None) -> list[CommittedSave]:
        folder_key = self._folder_key(folder)
        saves = []
        with self._reading(f"listing folder {folder!r}"):
            for key, obj in self._list(folder_key):
                relative = key[len(folder_key) :]
                if any(part.startswith(RESERVED_PREFIX) for part in relative.split("/")):
                    continue
                if relative.endswith("/" + MANIFEST):
                    save = self._read(key, key[: -len(MANIFEST) - 1], folder_key, obj["ETag"], is_prefix=False)
                elif relative.endswith(PREFIX_MANIFEST):
                    save = self._read(key, key[: -len(PREFIX_MANIFEST)], folder_key, obj["ETag"], is_prefix=True)
                else:
                    continue
                if save is not None and (run is None or save.run == run):
                    saves.append(save)
        return saves

    def committed_at(self, folder: str, export_dir: str) -> CommittedSave:
        target = self.target(folder, export_dir)
        folder_key = self._folder_key(folder)
        with self._reading(f"reading {export_dir!r} of folder {folder!r}"):
            save = self._read(f"{target}/{MANIFEST}", str(target), folder_key, None, is_prefix=False)
            if save is None:
                save = self._read(f"{target}{PREFIX_MANIFEST}", str(target), folder_key, None, is_prefix=True)
        if save is None:
            raise RunNotFoundError(
                f"no committed save at {export_dir!r} in folder {folder!r} of {self.url} (no {MANIFEST})"
            )
        return save

    def _manifest(self, key: str, etag: str | None) -> dict[str, Any] | None:
        """The parsed manifest at `key`, from the cache if its ETag is known and unchanged; None if absent."""
        with self._lock:
            cached = self._manifests.get(key)
        if cached is not None and etag is not None and cached[0] == etag:
            return cached[1]
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key)
        except Exception as e:
            if _code(e) in ("NoSuchKey", "404"):
                return None
            raise
        data = response["Body"].read()
        document = save_manifest.parse_manifest(data, key.rpartition("/")[2])
        with self._lock:
            self._manifests[key] = (response["ETag"], document)
        return document

    def _read(
        self, manifest_key: str, save_key: str, folder_key: str, etag: str | None, *, is_prefix: bool
    ) -> CommittedSave | None:
        try:
            document = self._manifest(manifest_key, etag)
            if document is None:
                return None
            return save_manifest.committed_save(
                document,
                PurePosixPath(save_key),
                save_key[len(folder_key) :],
                prefix=is_prefix,
                store_fields=_STORE_FIELDS,
            )
        except (save_manifest.ManifestError, KeyError, TypeError, ValueError) as e:
            _LOGGER.debug("not a committed save: %s (%s)", manifest_key, e)
            return None

    def _layout(self, save: CommittedSave) -> tuple[str, str]:
        """(files base, manifest key) of a committed save."""
        key = PurePosixPath(save.path)
        if save.prefix:
            return f"{key.parent}/", f"{key}{PREFIX_MANIFEST}"
        return f"{key}/", f"{key}/{MANIFEST}"

    @contextlib.contextmanager
    def local_copy(self, save: CommittedSave, progress: Callable[[int], None] | None = None) -> Iterator[CommittedSave]:
        files_base, manifest_key = self._layout(save)
        with self._reading(f"reading {save.path}"):
            document = self._manifest(manifest_key, None)
        if document is None:
            raise RunNotFoundError(f"the save {save.path} in {self.url} is no longer committed")
        self.staging_root.mkdir(parents=True, exist_ok=True)
        copy = self.staging_root / f"{TMP_PREFIX}restore-{secrets.token_hex(8)}"
        local = copy / PurePosixPath(save.path).name
        base = copy if save.prefix else local
        try:
            base.mkdir(parents=True)
            entries: list[save_manifest.FileEntry] = document["files"]
            with self._reading(f"downloading {save.path}"):
                futures = []
                for entry in entries:
                    (base / entry.path).parent.mkdir(parents=True, exist_ok=True)
                    futures.append(
                        self._transfer.download(
                            self.bucket,
                            files_base + entry.path,
                            str(base / entry.path),
                            subscribers=[_Progress(progress)] if progress is not None else None,
                        )
                    )
                for future in futures:
                    future.result()
            for entry in entries:
                size, value = save_manifest.file_checksum(base / entry.path)
                if size != entry.size or f"{value:08x}" != entry.crc32c.lower():
                    raise ChecksumError(
                        f"{files_base + entry.path} in {self.url} does not match its manifest "
                        f"({size} bytes, CRC32C {value:08x}; the manifest says {entry.size}, {entry.crc32c})"
                    )
            if not save.prefix:  # the dir as the local store has it, manifest included
                manifest_body = {**document, "files": [vars(e) for e in entries]}
                (local / MANIFEST).write_text(json.dumps(manifest_body, indent=1) + "\n")
            yield replace(save, path=local)
        finally:
            shutil.rmtree(copy, ignore_errors=True)

    # Deleting.

    def delete(self, save: CommittedSave) -> bool:
        files_base, manifest_key = self._layout(save)
        try:
            self._fence(save.run)  # only the run's writer deletes its saves
        except RunHeldError as e:
            _LOGGER.info("not deleting %s: %s", save.path, e)
            return False
        try:
            document = self._manifest(manifest_key, None)
            listed = [e.path for e in document["files"]] if document is not None else []
            self._delete_keys([manifest_key])  # the save stops counting first
        except Exception as e:
            _LOGGER.warning("could not delete %s from %s: %s", save.path, self.url, e)
            return False
        name = PurePosixPath(save.path).name
        keys = [files_base + rel for rel in listed if not save.prefix or rel.startswith(name + ".")]
        try:
            self._delete_keys(keys)
        except Exception as e:  # not a save any more; recover deletes them after the grace age
            _LOGGER.warning("could not delete the objects of %s: %s", save.path, e)
        return True

    def _delete_keys(self, keys: list[str]) -> None:
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
        with self._reading("listing run folders"):
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._base(), Delimiter="/"):
                for common in page.get("CommonPrefixes", []):
                    name = common["Prefix"][len(self._base()) :].rstrip("/")
                    if not name.startswith(RESERVED_PREFIX) and _is_run_name(name):
                        found.append(name)
        return sorted(found)

    def recover(self) -> int:
        """Deletes local staging leftovers, stale multipart uploads and uncommitted objects; returns how many."""
        fixed = 0
        if self.staging_root.is_dir():
            for entry in self.staging_root.iterdir():
                if entry.name.startswith(TMP_PREFIX):
                    shutil.rmtree(entry, ignore_errors=True)
                    fixed += 1
        cutoff = time.time() - self.grace_seconds
        # Tidying only: a bucket policy that denies listing uploads or
        # deleting must not stop the daemon from serving (leftovers are not saves).
        try:
            fixed += self._abort_stale_uploads(cutoff)
        except Exception as e:
            _LOGGER.warning("recover: could not abort stale multipart uploads under %s: %s", self.url, e)
        try:
            for folder in self.folders():
                doomed = self._uncommitted(self._folder_key(folder), cutoff)
                for key in doomed:
                    _LOGGER.info("recover: deleting %s, of no committed save", key)
                self._delete_keys(doomed)
                fixed += len(doomed)
        except Exception as e:
            _LOGGER.warning("recover: could not delete uncommitted objects under %s: %s", self.url, e)
        return fixed

    def _abort_stale_uploads(self, cutoff: float) -> int:
        aborted = 0
        paginator = self.client.get_paginator("list_multipart_uploads")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self._base()):
            for upload in page.get("Uploads", []):
                if upload["Initiated"].timestamp() < cutoff:
                    _LOGGER.info("recover: aborting the stale multipart upload of %s", upload["Key"])
                    self.client.abort_multipart_upload(
                        Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    aborted += 1
        return aborted

    def _uncommitted(self, folder_key: str, cutoff: float) -> list[str]:
        """Keys under a folder that no manifest lists, that checkpointd writes, older than `cutoff`."""
        objects = {key: obj for key, obj in self._list(folder_key)}
        listed: set[str] = set()
        for key in objects:
            if key.endswith("/" + MANIFEST):
                base = key[: -len(MANIFEST)]
            elif key.endswith(PREFIX_MANIFEST):
                base = key.rpartition("/")[0] + "/"
            else:
                continue
            try:
                document = self._manifest(key, objects[key]["ETag"])
            except save_manifest.ManifestError:
                continue
            if document is not None:
                listed.update(base + e.path for e in document["files"])
            listed.add(key)
        doomed = []
        for key, obj in objects.items():
            if key in listed or obj["LastModified"].timestamp() >= cutoff:
                continue
            relative = key[len(folder_key) :]
            name = relative.rpartition("/")[2]
            if _PREFIX_FILE.match(name) or any(
                _SAVE_DIR_FILE.match("/".join(relative.split("/")[i:])) for i in range(1, relative.count("/") + 1)
            ):
                doomed.append(key)
        return doomed

    # State files beside the saves.

    def read_file(self, path: PurePath) -> bytes | None:
        with self._reading(f"reading {path}"):
            try:
                return bytes(self.client.get_object(Bucket=self.bucket, Key=str(path))["Body"].read())
            except Exception as e:
                if _code(e) in ("NoSuchKey", "404"):
                    return None
                raise

    def write_file(self, path: PurePath, data: bytes) -> None:
        """Replaces a state file beside the saves, under the lease of the run(s) whose saves it names.

        Raises:
            RunHeldError: this daemon does not hold the lease of the folder's run.
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
            raise OSError(f"could not write {path} to {self.url}: {e}") from e


@contextlib.contextmanager
def _unavailable_on_error(what: str) -> Iterator[None]:
    """Turns the object store's failures into UnavailableError (retry later)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (BotoCoreError, ClientError) as e:
        raise UnavailableError(f"the object store failed {what}: {e}") from e


def _staged_files(staged: Path) -> list[str]:
    """Every file of a staged save but its manifest, '/'-separated, sorted (as its manifest lists them).

    Raises:
        OSError: an entry is not a regular file (a symlink, say): nothing of
            the save may go up, as its manifest would refuse it only later.
    """
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(staged):
        rel = PurePosixPath(Path(dirpath).relative_to(staged).as_posix())
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isfile(path):
                raise OSError(f"{path} is not a regular file; a save holds only regular files")
            found.append(str(rel / name))
    return sorted(f for f in found if f != MANIFEST)


class _ETagLog:
    """The ETag each upload of an awaited key was answered with, from the client's own responses.

    s3transfer returns nothing per upload; botocore's documented events do:
    `before-parameter-build` sees a request's Key (kept in its context),
    `after-call` its parsed answer. PutObject answers a single-request
    object's ETag, CompleteMultipartUpload a multipart one's, each only once
    the server has the whole object. Keys nobody awaits (the leases', the
    manifests') are not recorded.
    """

    _OPERATIONS = ("PutObject", "CompleteMultipartUpload")

    def __init__(self, client: Any) -> None:
        self._lock = threading.Lock()
        self._awaited: dict[tuple[str, str], dict[str, str]] = {}
        for operation in self._OPERATIONS:
            client.meta.events.register(f"before-parameter-build.s3.{operation}", self._note_key)
            client.meta.events.register(f"after-call.s3.{operation}", self._record)

    @contextlib.contextmanager
    def awaiting(self, bucket: str, keys: Iterable[str]) -> Iterator[dict[str, str]]:
        """Records the ETags of `keys`' uploads made inside the block, into the dict it yields (key -> ETag)."""
        etags: dict[str, str] = {}
        wanted = [(bucket, key) for key in keys]
        with self._lock:
            for item in wanted:
                self._awaited[item] = etags
        try:
            yield etags
        finally:
            with self._lock:
                for item in wanted:
                    if self._awaited.get(item) is etags:
                        del self._awaited[item]

    @staticmethod
    def _note_key(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["checkpointd_key"] = (params.get("Bucket"), params.get("Key"))

    def _record(self, parsed: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        item, etag = context.get("checkpointd_key"), str(parsed.get("ETag") or "").strip('"')
        if item is None or not etag or "Error" in parsed:
            return
        with self._lock:
            etags = self._awaited.get(item)
            if etags is not None:
                etags[item[1]] = etag


class _Progress:
    """An s3transfer subscriber that reports bytes as they arrive."""

    def __init__(self, report: Callable[[int], None]) -> None:
        self._report = report

    def on_queued(self, **_: Any) -> None:
        pass

    def on_progress(self, bytes_transferred: int, **_: Any) -> None:
        self._report(bytes_transferred)

    def on_done(self, **_: Any) -> None:
        pass


def _is_run_name(name: str) -> bool:
    try:
        check_run_name(name)
    except Exception:
        return False
    return True


def verify_bucket(store: S3Store, folders: list[str] | None = None) -> list[save_manifest.Report]:
    """Checks every committed save under the store's prefix (or in `folders`) against its manifest.

    Every listed object must be there with the listed size, ETag and CRC32C
    (read back in full). Objects no manifest lists are not saves and are
    not reported (recovery deletes checkpointd's own after the grace age).
    """
    reports = []
    for folder in store.folders() if folders is None else folders:
        for save in sorted(store.committed(folder, None), key=lambda s: str(s.path)):
            reports.append(_verify_save(store, save))
    return reports


def _verify_save(store: S3Store, save: CommittedSave) -> save_manifest.Report:
    import crc32c

    files_base, manifest_key = store._layout(save)
    where = f"s3://{store.bucket}/{save.path}"
    document = store._manifest(manifest_key, None)
    if document is None:
        return save_manifest.Report(where, False, "its manifest is gone")
    entries: list[save_manifest.FileEntry] = document["files"]
    etags = document.get(_ETAGS) or {}
    problems = []
    for entry in entries:
        key = files_base + entry.path
        try:
            response = store.client.get_object(Bucket=store.bucket, Key=key)
        except Exception as e:
            problems.append(f"{entry.path} is missing" if _code(e) in ("NoSuchKey", "404") else f"{entry.path}: {e}")
            continue
        size, value, body = 0, 0, response["Body"]
        for block in iter(functools.partial(body.read, 4 << 20), b""):
            size += len(block)
            value = crc32c.crc32c(block, value)
        etag = str(response.get("ETag", "")).strip('"')
        if size != entry.size:
            problems.append(f"{entry.path} has {size} bytes, the manifest says {entry.size}")
        elif f"{value:08x}" != entry.crc32c.lower():
            problems.append(f"{entry.path} has CRC32C {value:08x}, the manifest says {entry.crc32c}")
        elif entry.path in etags and etags[entry.path] != etag:
            problems.append(f"{entry.path} has ETag {etag}, the manifest says {etags[entry.path]} (rewritten)")
    passed = save_manifest.Report(
        where, True, run=save.run, kind=save.kind.value, step=save.step, files=len(entries),
        bytes=sum(e.size for e in entries),
    )  # fmt: skip
    if problems:
        more = len(problems) - 3
        return replace(passed, ok=False, reason="; ".join(problems[:3]) + (f" (and {more} more)" if more > 0 else ""))
    return passed
