"""The object store behind the Store seam, against a real S3 server (Ceph's radosgw, tests/integration/support/rgw.py).

What the local store guarantees, on S3: the same bytes, the manifest as
the commit marker (written last, listing every object with its ETag),
skip-if-busy and blocking through the upload, failure then recovery with
the server gone mid-save, retention, restore after a daemon restart, and a
start refused for wrong credentials or a missing bucket.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from checkpointd_client import RemoteCheckpointer, RemotePolicySaver, UnavailableError
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, start_daemon, wait_until
from tests.integration.support.raw import TIMEOUT
from tests.integration.support.rgw import Rgw

MANIFEST = "checkpointd.manifest.json"


def _objects(client: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object under `prefix`, by key relative to it."""
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            found[obj["Key"][len(prefix) :]] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return found


def _local_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class S3:
    """One test's daemons on its own prefix of the bucket, and its savers; all closed at teardown."""

    def __init__(self, server: Rgw, tmp_path: Path) -> None:
        self.rgw = server
        self.tmp = tmp_path
        self.prefix = f"t-{secrets.token_hex(4)}"
        self.client: Any = server.client()
        self.daemons: list[Daemon] = []
        self.savers: list[RemotePolicySaver] = []

    @property
    def url(self) -> str:
        return f"s3://{self.rgw.bucket}/{self.prefix}"

    def args(self) -> list[str]:
        return ["--s3-endpoint-url", self.rgw.endpoint, "--s3-region", "us-east-1"]

    def daemon(self, *extra: str) -> Daemon:
        n = len(self.daemons)
        d = start_daemon(
            self.url,  # type: ignore[arg-type]  # passed to --root as str(root)
            self.tmp / f"work{n}",
            "--work-dir",
            str(self.tmp / f"state{n}"),
            *self.args(),
            *extra,
            env=self.rgw.daemon_env(),
        )
        self.daemons.append(d)
        return d

    def saver(self, d: Daemon, policy: object, run: str, **kwargs: Any) -> tuple[RemotePolicySaver, tf.Variable]:
        step = tf.Variable(0, dtype=tf.int64)
        saver = RemotePolicySaver(policy, d.address, run=run, train_step=step, timeout=TIMEOUT, **kwargs)
        self.savers.append(saver)
        return saver, step

    def keys(self, under: str = "") -> set[str]:
        return set(_keys(self.client, self.rgw.bucket, f"{self.prefix}/{under}"))

    def close(self) -> None:
        for s in self.savers:
            try:
                s.close(timeout=10)
            except Exception:  # a test may have closed it, or its daemon be gone
                pass
        for d in self.daemons:
            if d.proc.poll() is None:
                d.terminate()


def _keys(client: Any, bucket: str, prefix: str) -> Iterator[str]:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            yield obj["Key"][len(prefix) :]


@pytest.fixture
def s3(rgw: Rgw, tmp_path: Path) -> Iterator[S3]:
    env = S3(rgw, tmp_path)
    try:
        yield env
    finally:
        env.close()


@pytest.fixture(scope="module")
def policy() -> object:
    return policies.build(policies.q(hidden=(8,)))


def test_a_policy_save_on_s3_is_byte_identical_to_the_local_stores(
    s3: S3, policy: object, fresh_daemon: Callable[..., Daemon]
) -> None:
    local = fresh_daemon()
    remote = s3.daemon()
    for d, root in ((local, "local"), (remote, "s3")):
        saver, step = s3.saver(d, policy, "same")
        step.assign(7)
        saver.save("policies/policy", blocking=True).result()
        saver.save_checkpoint("policies/checkpoints/policy_checkpoint_0000000007", blocking=True).result()
        del root
    on_disk = _local_files(local.root / "same")
    in_bucket = _objects(s3.client, s3.rgw.bucket, f"{s3.prefix}/same/")
    assert set(on_disk) == set(in_bucket)
    # Each daemon got its own export of the graph (TensorFlow numbers its
    # functions per export), so the SavedModel's graph is compared with the
    # S3 daemon's template, and every other file with the local store's.
    template = sorted((s3.tmp / "state0" / ".checkpointd" / "templates" / "same").rglob("saved_model.pb"))[-1]
    assert in_bucket["policies/policy/saved_model.pb"] == template.read_bytes()
    graph_bound = {"policies/policy/saved_model.pb", "policies/policy/fingerprint.pb", f"policies/policy/{MANIFEST}"}
    for rel, data in on_disk.items():
        if rel.endswith(MANIFEST):  # created_unix_seconds differs; the file list must not
            local_doc, remote_doc = json.loads(data), json.loads(in_bucket[rel])
            assert set(remote_doc["s3_etags"]) == {f["path"] for f in remote_doc["files"]}
            if rel not in graph_bound:
                assert local_doc["files"] == remote_doc["files"]
        elif rel not in graph_bound:
            assert in_bucket[rel] == data, rel
    assert sum(rel.startswith("policies/policy/variables/") for rel in on_disk) >= 2


def test_restore_and_latest_after_a_daemon_restart(s3: S3, policy: object) -> None:
    first = s3.daemon()
    saver, step = s3.saver(first, policy, "rs")
    values = []
    for n in (3, 4):
        policies.perturb(policy, seed=n)
        step.assign(n)
        saver.save_checkpoint(f"ckpt_{n}", blocking=True).result()
        values.append(policies.values(policy))
    saver.close(timeout=10)
    first.terminate()

    second = s3.daemon()
    again, step = s3.saver(second, policy, "rs")
    policies.perturb(policy, seed=99)
    latest = again.latest()
    assert latest is not None and (latest.export_dir, latest.step) == ("ckpt_4", 4)
    restored = again.restore()
    assert restored.step == 4 and int(step.numpy()) == 4
    for got, want in zip(policies.values(policy), values[1], strict=True):
        assert got.tobytes() == want.tobytes()
    assert again.restore("ckpt_3").step == 3
    for got, want in zip(policies.values(policy), values[0], strict=True):
        assert got.tobytes() == want.tobytes()


def test_retention_deletes_manifest_and_objects_of_old_saves(s3: S3, policy: object) -> None:
    d = s3.daemon("--keep-last", "2")
    saver, step = s3.saver(d, policy, "ret")
    for n in range(1, 5):
        step.assign(n)
        saver.save_checkpoint(f"ckpt_{n}", blocking=True).result()

    def kept() -> set[str]:
        return {k.split("/")[0] for k in s3.keys("ret/")}

    wait_until(lambda: kept() == {"ckpt_3", "ckpt_4"}, "retention to keep the 2 newest")
    assert f"ckpt_4/{MANIFEST}" in s3.keys("ret/")


def test_the_s3_server_gone_mid_save_fails_it_without_a_manifest_then_saves_resume(s3: S3) -> None:
    big = policies.build(policies.q(hidden=(1200, 1200)))  # about 6 MiB of variables
    d = s3.daemon()
    saver, step = s3.saver(d, big, "gone")
    step.assign(1)
    saver.save_checkpoint("ckpt_1", blocking=True).result()
    s3.rgw.stop_gateway()
    try:
        step.assign(2)
        # The store failed, not the save: UNAVAILABLE (the next save may commit), naming where it went.
        with pytest.raises(UnavailableError, match=f"ckpt_2: .*{s3.rgw.endpoint}"):
            saver.save_checkpoint("ckpt_2", blocking=True).result()
    finally:
        s3.rgw.start_gateway()
    assert not any(k.endswith(MANIFEST) for k in s3.keys("gone/ckpt_2"))
    step.assign(3)
    saver.save_checkpoint("ckpt_3", blocking=True).result()
    assert f"ckpt_3/{MANIFEST}" in s3.keys("gone/")
    latest = saver.latest()
    assert latest is not None and latest.step == 3


def test_flush_and_a_blocking_save_return_once_the_manifest_is_in_the_bucket(s3: S3, policy: object) -> None:
    d = s3.daemon()
    saver, step = s3.saver(d, policy, "fl")
    step.assign(1)
    ticket = saver.save("model")  # not blocking: accepted, uploaded in the background
    saver.flush(timeout=TIMEOUT)
    assert ticket.done() and f"model/{MANIFEST}" in s3.keys("fl/")
    step.assign(2)
    saver.save_checkpoint("ckpt", blocking=True).result()
    assert f"ckpt/{MANIFEST}" in s3.keys("fl/")
    staging = s3.tmp / "state0" / ".checkpointd" / "s3-staging"  # under the first daemon's --work-dir
    assert staging.is_dir() and list(staging.iterdir()) == []  # committed saves leave no local copy


def test_training_checkpoints_on_s3_keep_max_to_keep_and_restore_on_a_new_daemon(s3: S3) -> None:
    rng = np.random.default_rng(3)
    weights = tf.Variable(rng.standard_normal((3, 4)).astype(np.float32))
    global_step = tf.Variable(0, dtype=tf.int64)
    d = s3.daemon()
    with RemoteCheckpointer(
        "train", d.address, run="tc", timeout=TIMEOUT, max_to_keep=2, weights=weights, global_step=global_step
    ) as ckpt:
        for n in (1, 2, 3):
            global_step.assign(n)
            weights.assign_add(tf.ones_like(weights))
            ckpt.save(global_step, blocking=True).result()
    saved = weights.numpy().copy()
    wait_until(
        lambda: {k.split(".")[0] for k in s3.keys("tc/train/")} == {"checkpoint", "ckpt-2", "ckpt-3"},
        "max_to_keep=2 to delete ckpt-1",
    )
    keys = s3.keys("tc/train/")
    assert {"ckpt-3.checkpointd.manifest.json", "ckpt-3.index", "ckpt-3.data-00000-of-00001"} <= keys
    state = s3.client.get_object(Bucket=s3.rgw.bucket, Key=f"{s3.prefix}/tc/train/checkpoint")["Body"].read()
    assert b'model_checkpoint_path: "ckpt-3"' in state
    d.terminate()

    weights.assign(tf.zeros_like(weights))
    global_step.assign(0)
    again = s3.daemon()
    with RemoteCheckpointer(
        "train", again.address, run="tc", timeout=TIMEOUT, max_to_keep=2, weights=weights, global_step=global_step
    ) as ckpt:
        assert ckpt.checkpoint_exists
        ckpt.initialize_or_restore()
    assert int(global_step.numpy()) == 3
    np.testing.assert_array_equal(weights.numpy(), saved)


def _cli(s3: S3, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checkpointd", *args, *s3.args()],
        capture_output=True, text=True, timeout=120, env={**_base_env(), **s3.rgw.daemon_env()},
    )  # fmt: skip


def test_fetch_brings_the_newest_save_down_loadable_and_verify_reports_tampering(s3: S3, policy: object) -> None:
    d = s3.daemon()
    saver, step = s3.saver(d, policy, "fe")
    step.assign(5)
    saver.save("model", blocking=True).result()
    step.assign(6)
    saver.save_checkpoint("ckpt", blocking=True).result()

    fetched = _cli(s3, "fetch", "--root", s3.url, "fe/model", str(s3.tmp / "model"))
    assert fetched.returncode == 0, fetched.stderr
    loaded = tf.saved_model.load(str(s3.tmp / "model"))
    assert int(loaded.get_train_step().numpy()) == 5
    newest = _cli(s3, "fetch", "--root", s3.url, "fe", str(s3.tmp / "newest"))
    assert newest.returncode == 0, newest.stderr
    assert (s3.tmp / "newest" / "variables" / "variables.index").is_file() and "step 6" in newest.stderr
    assert _cli(s3, "fetch", "--root", s3.url, "fe/nothing", str(s3.tmp / "n")).returncode == 1

    ok = _cli(s3, "verify", f"{s3.url}/fe")
    assert ok.returncode == 0 and "2 OK, 0 FAILED" in ok.stdout, ok.stdout + ok.stderr
    # A save's own location (what SaveResult.path gives) checks that save alone.
    one = _cli(s3, "verify", f"{s3.url}/fe/model")
    assert one.returncode == 0 and "1 OK, 0 FAILED" in one.stdout and "/fe/model" in one.stdout, one.stdout
    absent = _cli(s3, "verify", f"{s3.url}/fe/nothing")
    assert absent.returncode == 1 and "no committed save there" in absent.stderr, absent.stdout + absent.stderr
    key = f"{s3.prefix}/fe/ckpt/variables/variables.index"
    original = s3.client.get_object(Bucket=s3.rgw.bucket, Key=key)["Body"].read()
    s3.client.put_object(Bucket=s3.rgw.bucket, Key=key, Body=bytes([original[0] ^ 1]) + original[1:])
    bad = _cli(s3, "verify", f"{s3.url}/fe")
    assert bad.returncode == 1 and "FAILED" in bad.stdout and "variables/variables.index has CRC32C" in bad.stdout


def test_a_big_file_goes_up_in_parallel_parts_each_checked_by_the_server(s3: S3, tmp_path: Path) -> None:
    from checkpointd.core.ports import SaveMeta, Staged
    from checkpointd.protocol.kinds import SaveKind
    from checkpointd.storage.s3 import S3Store

    store = S3Store(s3.url, tmp_path / "staging", part_bytes=5 << 20, client=s3.client)
    try:
        target = store.target("mp", "big")
        staging = store.stage(target)
        (staging / "variables").mkdir()
        data = np.random.default_rng(0).bytes(23 << 20)
        (staging / "variables" / "variables.data-00000-of-00001").write_bytes(data)
        (staging / "variables" / "variables.index").write_bytes(b"index")
        sent: list[tuple[bytes, str | bytes | None]] = []

        def record(request: Any, **_: Any) -> None:
            body = request.body
            if hasattr(body, "read"):  # a file chunk: read it, then rewind it for the send
                start = body.tell()
                data, _ = body.read(), body.seek(start)
            else:
                data = bytes(body)
            sent.append((data, request.headers.get("X-Amz-Content-SHA256")))

        s3.client.meta.events.register("before-send.s3.UploadPart", record)
        staged = Staged(staging, len(data) + 5, {})
        store.commit(staged, target, SaveMeta("mp", SaveKind.CHECKPOINT, 1, "big"))
        assert len(sent) == 5  # 23 MiB in 5 MiB parts
        # Over HTTP each part's SHA-256 is signed (the server refuses a body that does not match);
        # over HTTPS it would carry a Content-MD5 instead (tests/unit/s3/test_s3_store.py).
        for body, sha256 in sent:
            assert (sha256.decode() if isinstance(sha256, bytes) else sha256) == hashlib.sha256(body).hexdigest()
        manifest = json.loads(
            s3.client.get_object(Bucket=s3.rgw.bucket, Key=f"{s3.prefix}/mp/big/{MANIFEST}")["Body"].read()
        )
        assert manifest["s3_etags"]["variables/variables.data-00000-of-00001"].endswith("-5")  # a multipart ETag
        [save] = store.committed("mp", None)
        with store.local_copy(save) as local:
            assert (Path(local.path) / "variables" / "variables.data-00000-of-00001").read_bytes() == data

        # A body that does not match its Content-MD5 is refused by the server, not stored.
        def corrupt(params: dict[str, Any], **_: Any) -> None:
            params["headers"]["Content-MD5"] = "1B2M2Y8AsgTpgAmY7PhCfg=="  # the MD5 of b""

        s3.client.meta.events.register_last("before-call.s3.PutObject", corrupt)
        with pytest.raises(Exception, match="BadDigest|InvalidDigest"):
            s3.client.put_object(Bucket=s3.rgw.bucket, Key=f"{s3.prefix}/mp/x", Body=b"x")
        s3.client.meta.events.unregister("before-call.s3.PutObject", corrupt)
        assert not s3.keys("mp/x")

        # A multipart upload left by a crash is aborted by recovery once past the grace age.
        stale = s3.client.create_multipart_upload(Bucket=s3.rgw.bucket, Key=f"{s3.prefix}/mp/big2/variables/v")
        store.grace_seconds = 0
        store.tidy(lambda: False)
        uploads = s3.client.list_multipart_uploads(Bucket=s3.rgw.bucket, Prefix=f"{s3.prefix}/").get("Uploads", [])
        assert stale["UploadId"] not in {u["UploadId"] for u in uploads}
    finally:
        store.close()


def test_the_s3_server_killed_mid_multipart_upload_leaves_no_manifest_and_recovery_aborts_the_upload(
    s3: S3, tmp_path: Path
) -> None:
    from checkpointd.core.ports import SaveMeta, Staged
    from checkpointd.protocol.kinds import SaveKind
    from checkpointd.storage.s3 import S3Store

    store = S3Store(s3.url, tmp_path / "staging", part_bytes=5 << 20, max_concurrency=1, client=s3.client)
    meta = SaveMeta("mid", SaveKind.CHECKPOINT, 1, "big")
    data = np.random.default_rng(1).bytes(30 << 20)

    def staged() -> Staged:
        staging = store.stage(store.target("mid", "big"))
        (staging / "variables").mkdir()
        (staging / "variables" / "variables.data-00000-of-00001").write_bytes(data)
        return Staged(staging, len(data), {})

    def kill_after_the_first_part(**_: Any) -> None:
        s3.client.meta.events.unregister("after-call.s3.UploadPart", kill_after_the_first_part)
        s3.rgw.stop_gateway()

    try:
        first = staged()
        s3.client.meta.events.register("after-call.s3.UploadPart", kill_after_the_first_part)
        try:
            with pytest.raises(Exception, match="(?i)connect|endpoint|upload"):
                store.commit(first, store.target("mid", "big"), meta)
        finally:
            s3.client.meta.events.unregister("after-call.s3.UploadPart", kill_after_the_first_part)
            s3.rgw.start_gateway()
        store.discard(first.path)
        assert not any(k.endswith(MANIFEST) for k in s3.keys("mid/"))
        store.grace_seconds = 0
        store.tidy(lambda: False)  # the upload the kill cut short is aborted
        uploads = s3.client.list_multipart_uploads(Bucket=s3.rgw.bucket, Prefix=f"{s3.prefix}/mid/")
        assert not uploads.get("Uploads")

        store.commit(staged(), store.target("mid", "big"), meta)  # the server is back: the next save commits
        [save] = store.committed("mid", None)
        with store.local_copy(save) as local:
            assert (Path(local.path) / "variables" / "variables.data-00000-of-00001").read_bytes() == data
    finally:
        store.close()


def test_recovery_deletes_uncommitted_objects_it_made_after_the_grace_age(s3: S3, policy: object) -> None:
    bucket, base = s3.rgw.bucket, f"{s3.prefix}/rec/"
    for key in ("torn/variables/variables.index", "torn/saved_model.pb", "ckpts/ckpt-9.index", "notes.txt"):
        s3.client.put_object(Bucket=bucket, Key=base + key, Body=b"x")
    young = s3.daemon("--s3-grace-seconds", "3600")
    young.wait_recovered()
    young.terminate()
    assert len(s3.keys("rec/")) == 4  # younger than the grace age: perhaps a peer's save in progress
    old = s3.daemon("--s3-grace-seconds", "0")
    old.wait_recovered()  # the bucket is tidied while the daemon serves
    assert s3.keys("rec/") == {"notes.txt"}  # not a name checkpointd writes: never touched
    old.terminate()


@pytest.mark.parametrize("case", ["wrong-keys", "no-bucket"])
def test_wrong_credentials_or_a_missing_bucket_refuse_the_start(s3: S3, case: str) -> None:
    env = dict(s3.rgw.daemon_env())
    url = s3.url
    if case == "wrong-keys":
        env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    else:
        url = "s3://no-such-bucket-here/x"
    proc = subprocess.run(
        [sys.executable, "-m", "checkpointd", "serve", "--root", url, "--port", "0", "--metrics-port", "-1",
         "--work-dir", str(s3.tmp / "w"), *s3.args()],
        capture_output=True, text=True, timeout=60, env={**_base_env(), **env},
    )  # fmt: skip
    assert proc.returncode == 2
    assert ("refused" if case == "wrong-keys" else "does not exist") in proc.stderr
    assert "not-the-secret" not in proc.stderr


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}


def test_a_streamed_data_file_goes_up_part_by_part_as_its_ranges_fill_and_commits_only_at_the_manifest(
    s3: S3, tmp_path: Path
) -> None:
    from checkpointd.bundle import Entry
    from checkpointd.bundle.sink import BundleSink
    from checkpointd.core.ports import SaveMeta, Staged
    from checkpointd.protocol.kinds import SaveKind
    from checkpointd.storage.s3 import S3Store

    store = S3Store(s3.url, tmp_path / "staging", part_bytes=5 << 20, client=s3.client)
    mib = 1 << 20
    # Three tensors in data order; the wire sends the last one first (a policy's wire order is not its data's).
    sizes = [7 * mib, 6 * mib, 4 * mib]  # 17 MiB: parts [0,5) [5,10) [10,15) [15,17) MiB
    values = [np.random.default_rng(i).bytes(n) for i, n in enumerate(sizes)]
    entries = [Entry(f"t{i}", "float32", (n // 4,), n) for i, n in enumerate(sizes)]
    data_key = f"{s3.prefix}/st/big/variables/variables.data-00000-of-00001"

    def parts_up(upload_id: str) -> list[int]:
        """Which of the four parts are up (numbered apart, room for an incremental save's copies between)."""
        listed = s3.client.list_parts(Bucket=s3.rgw.bucket, Key=data_key, UploadId=upload_id)
        return sorted((p["PartNumber"] - 1) // (10_000 // 4) + 1 for p in listed.get("Parts", []))

    def open_save(name: str) -> tuple[Path, BundleSink]:
        target = store.target("st", name)
        staging = store.stage(target)
        (staging / "variables").mkdir()

        def finish(index: bytes, tail: bytes) -> Staged:
            return Staged(staging, sum(sizes) + len(index), {})

        sink = BundleSink(staging / "variables" / "variables", entries, [2, 0, 1], [sizes[2], *sizes[:2]], finish)
        store.stream(staging, target, SaveMeta("st", SaveKind.CHECKPOINT, 1, name), sink)
        return staging, sink

    try:
        staging, sink = open_save("big")
        sink.write(0, 0, values[2])  # [13, 17) MiB: only the last part is whole

        def uploads() -> list[dict[str, Any]]:
            found = s3.client.list_multipart_uploads(Bucket=s3.rgw.bucket, Prefix=f"{s3.prefix}/st/")
            return list(found.get("Uploads", []))

        wait_until(lambda: bool(uploads()), "the data file's multipart upload", TIMEOUT)
        [upload] = uploads()
        assert upload["Key"] == data_key
        wait_until(lambda: parts_up(upload["UploadId"]) == [4], "the last part's upload", TIMEOUT)
        sink.write(1, 0, values[0])  # [0, 7): the first part
        sink.write(2, 0, values[1][: 2 * mib])  # [7, 9): nothing new is whole
        wait_until(lambda: parts_up(upload["UploadId"]) == [1, 4], "the first part's upload", TIMEOUT)
        assert not s3.keys("st/big")  # parts are no object: nothing is under the save's keys yet
        sink.write(2, 2 * mib, values[1][2 * mib :])
        staged = sink.finish()
        store.commit(staged, store.target("st", "big"), SaveMeta("st", SaveKind.CHECKPOINT, 1, "big"))
        assert not s3.client.list_multipart_uploads(Bucket=s3.rgw.bucket, Prefix=f"{s3.prefix}/").get("Uploads")
        got = s3.client.get_object(Bucket=s3.rgw.bucket, Key=data_key)["Body"].read()
        assert got == values[0] + values[1] + values[2]
        manifest = json.loads(
            s3.client.get_object(Bucket=s3.rgw.bucket, Key=f"{s3.prefix}/st/big/{MANIFEST}")["Body"].read()
        )
        assert manifest["s3_etags"]["variables/variables.data-00000-of-00001"].endswith("-4")

        # A save given up mid-stream: its upload is aborted, nothing is left under its keys.
        staging, sink = open_save("gone")
        sink.write(1, 0, values[0])
        sink.close()
        store.discard(staging)
        assert not s3.client.list_multipart_uploads(Bucket=s3.rgw.bucket, Prefix=f"{s3.prefix}/").get("Uploads")
        assert not s3.keys("st/gone")
    finally:
        store.close()


def test_a_runs_next_policy_save_copies_the_graph_files_server_side_and_uploads_only_what_changed(
    s3: S3, policy: object
) -> None:
    from tests.integration.support import scrape

    d = s3.daemon()
    saver, step = s3.saver(d, policy, "cp")

    def uploaded() -> float:
        return scrape.Metrics(d.metrics_url)("checkpointd_store_uploaded_bytes_total", kind="saved_model")

    step.assign(1)
    saver.save("p/1", blocking=True).result()
    first = uploaded()
    step.assign(2)
    saver.save("p/2", blocking=True).result()
    second = uploaded() - first
    in_bucket = _objects(s3.client, s3.rgw.bucket, f"{s3.prefix}/cp/p/")
    manifest = json.loads(in_bucket[f"2/{MANIFEST}"])
    changed = {"variables/variables.data-00000-of-00001", "variables/variables.index", "fingerprint.pb"}
    variables = sum(f["size"] for f in manifest["files"] if f["path"].startswith("variables/"))
    assert in_bucket["2/saved_model.pb"] == in_bucket["1/saved_model.pb"]
    # The second save sent its variables, fingerprint and manifest; the graph files were copied.
    graph = sum(f["size"] for f in manifest["files"] if f["path"] not in changed)
    assert graph > 0 and 0 < second <= variables + len(in_bucket[f"2/{MANIFEST}"]) + (64 << 10)
    assert first - second >= graph - (64 << 10)
    # Copied or not, each object is what the manifest says (sizes, ETags), and the save loads.
    for f in manifest["files"]:
        head = s3.client.head_object(Bucket=s3.rgw.bucket, Key=f"{s3.prefix}/cp/p/2/{f['path']}")
        assert head["ContentLength"] == f["size"] and head["ETag"].strip('"') == manifest["s3_etags"][f["path"]]
    ok = _cli(s3, "verify", f"{s3.url}/cp")
    assert ok.returncode == 0 and "2 OK, 0 FAILED" in ok.stdout, ok.stdout + ok.stderr


def test_saves_into_new_dirs_make_no_head_and_one_replacing_a_save_in_place_still_unpublishes_it_first(
    s3: S3, policy: object
) -> None:
    from tests.integration.support import scrape

    s3.client.put_object(Bucket=s3.rgw.bucket, Key=f"{s3.prefix}/pl/p/9/leftover", Body=b"x")  # a dir in use
    d = s3.daemon()
    saver, step = s3.saver(d, policy, "pl")

    def heads() -> float:
        samples = scrape.Metrics(d.metrics_url).samples
        return samples.get(("checkpointd_s3_requests_total", frozenset({("operation", "HeadObject")})), 0.0)

    for n in (1, 2, 3):
        step.assign(n)
        saver.save(f"p/{n}", blocking=True).result()
    assert heads() == 0  # the first save listed p/ once: nothing in 1, 2 or 3
    step.assign(4)
    saver.save("p/2", blocking=True).result()  # in place: the old save stops counting first
    step.assign(5)
    saver.save("p/9", blocking=True).result()  # a dir that held objects before the daemon came
    assert heads() == 2
    in_bucket = _objects(s3.client, s3.rgw.bucket, f"{s3.prefix}/pl/p/")
    assert {k for k in in_bucket if k.endswith(MANIFEST)} == {f"{n}/{MANIFEST}" for n in (1, 2, 3, 9)}
    assert json.loads(in_bucket[f"2/{MANIFEST}"])["step"] == 4
    ok = _cli(s3, "verify", f"{s3.url}/pl")
    assert ok.returncode == 0 and "4 OK, 0 FAILED" in ok.stdout, ok.stdout + ok.stderr
