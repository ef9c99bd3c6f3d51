"""Incremental policy saves on S3 (radosgw): the unchanged variables copied server-side from the run's newest save.

A QPolicy whose middle layer (2,300 x 2,300 float32, 21 MB: more than one
16 MiB part of its data file) stays frozen while its output layer trains.
Two savers on one daemon save the same values, one incremental (the
default) and one with `incremental=False`: the incremental save's objects
must equal the full one's byte for byte, whichever way the snapshot
travelled (gRPC or shared memory), and the SavedModel must load from its
objects alone with the saved values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tests.integration.s3.test_s3 import S3, _objects, s3  # noqa: F401  (the fixture)
from tests.integration.support import policies
from tests.integration.support.raw import TIMEOUT

MiB = 1 << 20


@pytest.fixture(scope="module")
def policy() -> object:
    return policies.build(policies.q(hidden=(64, 2300, 2300)))


def _train_output_layer(policy: object, by: float) -> None:
    last = policy.variables()[-1]  # type: ignore[attr-defined]  # the output layer's bias
    last.assign_add(tf.fill(last.shape, by))


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_policy_saves_on_s3_copy_the_unchanged_variables_and_match_a_full_save(
    s3: S3,  # noqa: F811
    policy: object,
    tmp_path: Path,
    shared_memory: bool,
) -> None:
    daemon = s3.daemon()
    runs = ("pi-incr", "pi-full")
    pairs = [
        s3.saver(daemon, policy, run, shared_memory=shared_memory, incremental=incremental)
        for run, incremental in zip(runs, (True, False), strict=True)
    ]

    def save(export_dir: str, step: int) -> list[object]:
        results = []
        for saver, train_step in pairs:
            train_step.assign(step)
            results.append(saver.save(export_dir, blocking=True).result(TIMEOUT))
        return results

    first, _ = save("p/1", 1)
    assert first.bytes_copied == 0  # type: ignore[attr-defined]  # no base yet
    _train_output_layer(policy, 0.5)
    incr, full = save("p/2", 2)
    # The frozen 21 MB: at least the data file's first 16 MiB part copied in the bucket, not sent.
    assert incr.bytes_copied >= 10 * MiB and full.bytes_copied == 0  # type: ignore[attr-defined]
    got = _objects(s3.client, s3.rgw.bucket, f"{s3.prefix}/{runs[0]}/p/2/")
    want = _objects(s3.client, s3.rgw.bucket, f"{s3.prefix}/{runs[1]}/p/2/")
    variables = [k for k in want if k.startswith("variables/")]
    assert len(variables) == 2 and all(got[k] == want[k] for k in variables)
    # Loadable from the incremental save's objects alone, with the values saved.
    for key, data in got.items():
        (tmp_path / "p2" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "p2" / key).write_bytes(data)
    loaded = tf.saved_model.load(str(tmp_path / "p2"))
    saved = {v.name: v.numpy() for v in loaded.model_variables}
    for v in policy.variables():  # type: ignore[attr-defined]
        np.testing.assert_array_equal(saved[v.name], v.numpy())
