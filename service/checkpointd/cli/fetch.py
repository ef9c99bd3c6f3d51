"""`checkpointd fetch` and `checkpointd verify s3://...`: committed saves in an object store, offline.

`fetch` brings one committed save (a run's newest by default) down to a
local dir, checked against its manifest (sizes and CRC32C), with a progress
line: TensorFlow 2.15 cannot read s3:// itself (the tensorflow-io release
that matches it crashes on S3), so `tf.saved_model.load`, `policy_loader`
and `tf.train.latest_checkpoint` read the fetched copy. `verify` reads every
object of every committed save back and checks size, CRC32C and ETag.
No daemon and no TensorFlow: boto3 and crc32c only.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import IO

from checkpointd.cli.verify import ProgressLine, print_reports
from checkpointd.cli.verify_bucket import verify_bucket
from checkpointd.core.ports import CommittedSave
from checkpointd.core.retention import age
from checkpointd.protocol.errors import CheckpointdError, RunNotFoundError
from checkpointd.protocol.names import check_run_name
from checkpointd.storage.s3 import S3Store, S3Url


def _store(root: str, endpoint_url: str | None, region: str | None, work: Path) -> S3Store:
    store = S3Store(root, work, endpoint_url=endpoint_url, region=region)
    try:
        store.check()
    except BaseException:
        store.close()
        raise
    return store


def fetch(
    root: str,
    save: str,
    dest: Path,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    progress: bool | None = None,
    err: IO[str] | None = None,
) -> int:
    """`checkpointd fetch`: copies RUN[/EXPORT_DIR] from `root` to `dest`; returns the exit code.

    EXPORT_DIR names a save, or a dir of saves (`train`, a training-checkpoint
    dir), whose newest committed save is fetched; no EXPORT_DIR, the run
    folder's newest. On a terminal (or with `progress`), a progress line.

    A save that is a dir of its own becomes `dest` (which must not exist); a
    training checkpoint's files `<name>.*` go into the dir `dest`, with a
    `checkpoint` state file naming it, so `tf.train.latest_checkpoint(dest)` finds it.
    Exit 0 when fetched and checked, 1 when no such save or a file is corrupt, 2 for setup errors.
    """
    err = err or sys.stderr
    folder, _, export_dir = save.partition("/")
    try:
        check_run_name(folder)
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            err.write(f"checkpointd fetch: {dest} exists and is not an empty dir\n")
            return 2
        dest.parent.mkdir(parents=True, exist_ok=True)
        store = _store(root, endpoint_url, region, dest.parent)
    except (CheckpointdError, OSError, ValueError) as e:
        err.write(f"checkpointd fetch: {e}\n")
        return 2
    try:
        chosen = _choose(store, folder, export_dir)
        if chosen is None:
            where = f"{folder}/{export_dir}" if export_dir else folder
            err.write(f"checkpointd fetch: no committed save in {root.rstrip('/')}/{where}\n")
            return 1
        total = _listed_bytes(store, chosen)
        line = ProgressLine(err, "fetched", total) if (err.isatty() if progress is None else progress) else None
        with store.local_copy(chosen, line) as local:
            _place(Path(local.path), chosen, dest)
        if line is not None:
            line.end()
        err.write(f"fetched s3://{store.bucket}/{chosen.path} ({chosen.kind.value}, step {chosen.step}) to {dest}\n")
        return 0
    except CheckpointdError as e:
        err.write(f"checkpointd fetch: {e}\n")
        return 1
    finally:
        store.close()


def _choose(store: S3Store, folder: str, export_dir: str) -> CommittedSave | None:
    """The save RUN[/EXPORT_DIR] names: that save, or the newest one in the folder or under that dir.

    EXPORT_DIR may be a save (a SavedModel, `train/ckpt-7`) or a dir of
    saves: a training-checkpoint dir (`train`, as `tf.train.latest_checkpoint`
    takes one) or a policies dir; then its newest committed save is fetched.
    """
    if export_dir:
        try:
            return store.committed_at(folder, export_dir)
        except RunNotFoundError:
            pass
    below = export_dir.strip("/") + "/" if export_dir else ""
    saves = [s for s in store.committed(folder, None) if s.export_dir.startswith(below)]
    return max(saves, key=age) if saves else None


def _listed_bytes(store: S3Store, save: CommittedSave) -> int:
    document = store.manifest(store.keys_of(save).manifest, None) or {"files": []}
    return sum(e.size for e in document["files"])


def _place(local: Path, save: CommittedSave, dest: Path) -> None:
    if not save.prefix:
        if dest.exists():
            dest.rmdir()
        shutil.move(str(local), dest)
        return
    dest.mkdir(parents=True, exist_ok=True)
    name = PurePosixPath(save.path).name
    for entry in os.listdir(local.parent):
        if entry.startswith(name + "."):
            shutil.move(str(local.parent / entry), dest / entry)
    state = f'model_checkpoint_path: "{name}"\nall_model_checkpoint_paths: "{name}"\n'
    (dest / "checkpoint").write_text(state)


def verify(
    urls: Sequence[str],
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    as_json: bool = False,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
) -> int:
    """`checkpointd verify s3://BUCKET[/PREFIX[/RUN[/EXPORT_DIR]]]`: 0 if every save named is intact, 1 if not, 2 on setup errors.

    A URL is read as the longest PREFIX whose next component is a run folder
    holding saves: `s3://b/p/run` checks that run, `s3://b/p/run/policies/7`
    that one save (what a SaveResult's path gives), `s3://b/p` every run.
    """
    out, err = out or sys.stdout, err or sys.stderr
    reports = []
    for url in urls:
        parsed = S3Url.parse(url)
        parts = parsed.prefix.split("/") if parsed.prefix else []
        try:
            checked: list = []
            named_a_save = False  # a run folder exists with something below it named
            for k in range(len(parts) - 1, -1, -1):  # the run folder is parts[k]; below it, a save or a dir of saves
                base, folder, below = "/".join(parts[:k]), parts[k], "/".join(parts[k + 1 :])
                store = _store(f"s3://{parsed.bucket}/{base}", endpoint_url, region, Path.cwd())
                try:
                    if folder in store.folders():
                        checked = verify_bucket(store, [folder], below)
                        named_a_save = named_a_save or bool(below)
                finally:
                    store.close()
                if checked:
                    break
            if not checked:
                store = _store(url, endpoint_url, region, Path.cwd())
                try:
                    checked = verify_bucket(store)
                finally:
                    store.close()
            if not checked and named_a_save:
                err.write(f"checkpointd verify: {url}: no committed save there\n")
                return 1
            reports.extend(checked)
        except (OSError, ValueError) as e:
            err.write(f"checkpointd verify: {e}\n")
            return 2
    return print_reports(reports, as_json, out)
