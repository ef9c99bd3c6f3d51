"""The soak's invariant checker (tests.integration.support.soak): what the trainers were told, against the roots.

Each run's committed saves are read where they are: L's from its local root,
S1's and S2's from the bucket (every object under the run's folder copied to
a local dir first, as the keys lay them out). Then, per run:

- `verify_paths` on the run: every save with a manifest is complete (sizes,
  CRC32C), so no save is partial;
- each step a trainer was told committed: a training checkpoint `ckpt-N` is
  there and its weights and step are `soak.values(N)` and N, bit for bit; a
  policy dir holds N or a later step of that dir, every float of it
  `soak.policy_value(step)`;
- each step a trainer was told failed: its training checkpoint, if there, is
  complete and bit-identical too;
- on S3, each manifest's writer (`<host>-<pid>-<hex>`) is an incarnation of
  the run's own daemon, and in the order of their start times by the
  manifests' creation times: no run had two writers.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.integration.support import soak


def _download(client: Any, bucket: str, prefix: str, run: str, into: Path) -> Path:
    """Every object under `<prefix>/<run>/` copied to `into/<run>/...`; returns that dir."""
    base = f"{prefix}/{run}/"
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
        for obj in page.get("Contents", []):
            target = into / run / obj["Key"][len(base) :]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
    return into / run


def _manifests(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Every manifest of the run: its save's place (relative, e.g. train/ckpt-7 or policy-1) -> its content."""
    found = {}
    for path in run_dir.rglob("*" + soak.DIR_MANIFEST):
        if path.name.endswith(soak.MANIFEST):  # a prefix's: ckpt-N.checkpointd.manifest.json
            place = path.with_name(path.name[: -len(soak.MANIFEST)])
        elif path.name == soak.DIR_MANIFEST:  # a dir's
            place = path.parent
        else:
            continue
        found[str(place.relative_to(run_dir))] = json.loads(path.read_text())
    return found


def _training_problem(run_dir: Path, step: int) -> str | None:
    """Whether training checkpoint `ckpt-step` loads with exactly the values of `step`."""
    import tensorflow as tf

    try:
        reader = tf.train.load_checkpoint(str(run_dir / "train" / f"ckpt-{step}"))
        weights = reader.get_tensor("weights/.ATTRIBUTES/VARIABLE_VALUE")
        saved_step = int(reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE"))
    except Exception as e:  # noqa: BLE001 - any load error is the finding
        return f"ckpt-{step} does not load: {type(e).__name__}: {e}"
    if saved_step != step or weights.tobytes() != soak.values(step).tobytes():
        return f"ckpt-{step} holds other values (its step {saved_step})"
    return None


def _policy_problem(run_dir: Path, export_dir: str, step: int) -> str | None:
    """Whether policy dir `export_dir` holds exactly the values of `step`."""
    import tensorflow as tf

    try:
        reader = tf.train.load_checkpoint(str(run_dir / export_dir / "variables" / "variables"))
        tensors = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}
    except Exception as e:  # noqa: BLE001
        return f"{export_dir} does not load: {type(e).__name__}: {e}"
    floats = [t for t in tensors.values() if isinstance(t, np.ndarray) and t.dtype == np.float32]
    if not floats or any((t != soak.policy_value(step)).any() for t in floats):
        return f"{export_dir} holds other values than step {step}'s"
    return None


def check(
    events: list[dict[str, Any]],
    pids: dict[str, list[int]],
    client: Any,
    bucket: str,
    prefix: str,
    local: Path,
    work: Path,
    figures: soak.Figures,
) -> None:
    """Checks the invariants of the module docstring; adds to `figures` (counts, violations)."""
    from checkpointd.cli.verify import verify_paths

    told: dict[tuple[str, str], dict[int, str]] = collections.defaultdict(dict)  # (run, event) -> step -> dir
    for e in events:
        figures.saves[e["event"]] += 1
        if e["event"] == "failed":
            figures.failed_why[e["why"]] += 1
        if e["event"] in ("committed", "failed"):
            told[e["run"], e["event"]][e["step"]] = e["dir"]
    for run, on, kind, _ in soak.TRAINERS:
        run_dir = local / run if on == "L" else _download(client, bucket, prefix, run, work)
        if not run_dir.is_dir():
            figures.violations.append(f"{run}: nothing of it is in its root")
            continue
        bad = [r for r in verify_paths([run_dir]) if not r.ok and "no save dirs" not in r.reason]
        figures.violations += [f"{run}: verify {r.path}: {r.reason}" for r in bad]
        manifests = _manifests(run_dir)
        figures.checked["committed saves in the roots"] += len(manifests)
        committed, failed = told[run, "committed"], told[run, "failed"]
        if kind == "train":
            for step in committed:
                figures.checked["told committed, loaded"] += 1
                if f"train/ckpt-{step}" not in manifests:
                    figures.violations.append(f"{run}: told step {step} committed; it is not in the root")
                elif problem := _training_problem(run_dir, step):
                    figures.violations.append(f"{run}: {problem}")
            for step in set(failed) - set(committed):
                if f"train/ckpt-{step}" in manifests:
                    figures.checked["told failed, found complete"] += 1
                    if problem := _training_problem(run_dir, step):
                        figures.violations.append(f"{run}: told failed, and partial or other: {problem}")
                else:
                    figures.checked["told failed, absent"] += 1
        else:
            for export_dir in {d for d in committed.values() if d}:
                newest = max(s for s, d in committed.items() if d == export_dir)
                held = manifests.get(export_dir, {}).get("step")
                figures.checked["policy dirs loaded"] += 1
                if held is None or held < newest:
                    figures.violations.append(f"{run}: {export_dir} holds step {held}, told {newest} committed")
                elif problem := _policy_problem(run_dir, export_dir, held):
                    figures.violations.append(f"{run}: {problem}")
        if on != "L":
            _one_writer(run, manifests, pids[on], figures)


def _one_writer(run: str, manifests: dict[str, dict[str, Any]], pids: list[int], figures: soak.Figures) -> None:
    """On S3: every manifest's writer is an incarnation of the run's daemon, incarnations in time order."""
    from checkpointd.storage.s3.keys import WRITER

    order = []
    for place, doc in manifests.items():
        writer = str(doc.get(WRITER, ""))
        pid = int(writer.rsplit("-", 2)[1]) if writer.count("-") >= 2 else -1
        if pid not in pids:
            figures.violations.append(f"{run}: {place} was written by {writer!r}, not by its daemon {pids}")
            continue
        order.append((doc["created_unix_seconds"], pids.index(pid), place))
    figures.checked["S3 manifests' writers"] += len(order)
    incarnations = [i for _, i, _ in sorted(order)]
    if incarnations != sorted(incarnations):
        figures.violations.append(f"{run}: an older incarnation of its daemon wrote after a newer one")
