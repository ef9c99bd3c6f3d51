"""Where a save's objects and manifest are in the bucket: one decision, and its inverse (no boto3, no bucket)."""

from __future__ import annotations

import pytest

from checkpointd.storage.s3 import keys as s3_keys
from checkpointd.storage.s3.keys import MANIFEST, PREFIX_MANIFEST, SaveKeys


def test_a_dir_save_keeps_its_files_and_manifest_under_its_own_key() -> None:
    assert s3_keys.keys_of("base/run1/policy_3", prefix=False) == SaveKeys(
        "base/run1/policy_3/", f"base/run1/policy_3/{MANIFEST}"
    )


def test_a_checkpoint_prefix_keeps_its_files_beside_its_dir_and_its_manifest_after_its_name() -> None:
    keys = s3_keys.keys_of("run1/train/ckpt-4", prefix=True)
    assert keys == SaveKeys("run1/train/", f"run1/train/ckpt-4{PREFIX_MANIFEST}")


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("save_key", ["run1/policy", "b/run1/a/b/ckpt-12", "run1/x.y"])
def test_save_of_inverts_keys_of(save_key: str, prefix: bool) -> None:
    assert s3_keys.save_of(s3_keys.keys_of(save_key, prefix=prefix).manifest) == (save_key, prefix)


@pytest.mark.parametrize(
    "key", ["run1/policy/saved_model.pb", "run1/train/ckpt-4.index", MANIFEST, "run1/train/checkpoint"]
)
def test_a_key_that_is_no_manifest_names_no_save(key: str) -> None:
    assert s3_keys.save_of(key) is None
