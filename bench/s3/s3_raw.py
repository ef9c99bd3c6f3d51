"""The S3 section's baselines: raw multipart PUTs of a save's files (boto3, and obstore when installed)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

REGION = "us-east-1"

Files = list[tuple[Path, str]]  # (local path, key relative to the save)
RawPut = Callable[[Files, str], None]  # PUTs the files of a save under a key prefix, all at once


def boto3_puts(endpoint: str, bucket: str, part_bytes: int, concurrency: int) -> dict[str, RawPut]:
    """The boto3 raw PUTs: plain, with Content-MD5, and with Content-MD5 plus a head per object."""
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    from checkpointd.storage.s3 import content_md5, make_client

    def via(md5: bool, head: bool) -> RawPut:
        # The store's client (make_client, with its pool of 4 x concurrency),
        # with the Content-MD5 hook or without it whatever the endpoint (the
        # store sends it over HTTPS only; over HTTP the body's SHA-256 is signed).
        client = make_client(endpoint, REGION, 4 * concurrency)
        for operation in ("PutObject", "UploadPart"):
            client.meta.events.unregister(f"before-call.s3.{operation}", content_md5)
            if md5:
                client.meta.events.register(f"before-call.s3.{operation}", content_md5)
        transfers = create_transfer_manager(
            client,
            TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes, max_concurrency=concurrency),
        )

        def upload(files: Files, key_base: str) -> None:
            futures = [transfers.upload(str(path), bucket, key_base + rel) for path, rel in files]
            for future in futures:
                future.result()
            for path, rel in files if head else ():
                if client.head_object(Bucket=bucket, Key=key_base + rel)["ContentLength"] != path.stat().st_size:
                    raise RuntimeError(f"{key_base + rel} has the wrong size in the bucket")

        return upload

    return {
        "boto3": via(md5=False, head=False),
        "boto3_md5": via(md5=True, head=False),
        "boto3_md5_head": via(md5=True, head=True),
    }


def obstore_put(endpoint: str, bucket: str, part_bytes: int, concurrency: int) -> RawPut:
    """obstore's put_async of every file at once, each multipart above `part_bytes` with `concurrency` parts."""
    import obstore
    from obstore.store import S3Store as ObjectStore

    store = ObjectStore(
        bucket,
        endpoint=endpoint,
        region=REGION,
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        virtual_hosted_style_request=False,
        client_options={"allow_http": endpoint.startswith("http://")},
    )
    loop = asyncio.new_event_loop()

    async def put_all(files: Files, key_base: str) -> None:
        puts = (
            obstore.put_async(store, key_base + rel, path, chunk_size=part_bytes, max_concurrency=concurrency)
            for path, rel in files
        )
        await asyncio.gather(*puts)

    return lambda files, key_base: loop.run_until_complete(put_all(files, key_base))


def timed(raw: RawPut, files: Files, key_base: str) -> float:
    start = time.perf_counter()
    raw(files, key_base)
    return time.perf_counter() - start
