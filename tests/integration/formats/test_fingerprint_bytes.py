"""fingerprint.pb as the daemon assembles it: protobuf's own bytes for every checkpoint_hash."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import tensorflow as tf
from tensorflow.core.protobuf import fingerprint_pb2

from checkpointd.formats import policy


def _template_fingerprint() -> bytes:
    return fingerprint_pb2.FingerprintDef(
        saved_model_checksum=0xFEDCBA9876543210,
        graph_def_program_hash=12345,
        signature_def_hash=1,
        saved_object_graph_hash=(1 << 64) - 1,
        checkpoint_hash=777,  # the template's own: replaced
        version={"producer": 1},
    ).SerializeToString()


@pytest.mark.parametrize("value", [0, 1, 127, 128, 0x0123456789ABCDEF, (1 << 64) - 1])
def test_cut_template_plus_a_hash_is_protobufs_serialization(value: int) -> None:
    before, after = policy._fingerprint_around(_template_fingerprint())
    ours = before + (policy._CHECKPOINT_HASH_TAG + policy.varint.encode(value) if value else b"") + after
    expected = fingerprint_pb2.FingerprintDef.FromString(_template_fingerprint())
    expected.checkpoint_hash = value
    assert ours == expected.SerializeToString()


def test_checkpoint_hash_is_tensorflows_fingerprint64_of_the_index() -> None:
    rng = random.Random(7)
    for size in (0, 1, 16, 17, 33, 64, 65, 531, 4096):
        index = rng.randbytes(size)
        template = SimpleNamespace(fingerprint=_template_fingerprint())  # all of a Template it reads
        got = fingerprint_pb2.FingerprintDef.FromString(policy._fingerprint(template, index))  # type: ignore[arg-type]
        digest = tf.fingerprint(tf.constant([index]), method="farmhash64").numpy()  # the public op, str method
        assert got.checkpoint_hash == int.from_bytes(digest.tobytes(), "little"), size
        assert got.saved_model_checksum == 0xFEDCBA9876543210
        assert got.version.producer == 1
