"""Manifests: sizes, offsets, and checking a save's declared snapshot against them."""

from __future__ import annotations

import pytest

from checkpointd.core.variable_manifest import Manifest, VariableSpec
from checkpointd.protocol.errors import InvalidRequestError, LimitExceededError
from checkpointd.protocol.tensors import ITEMSIZE


def var(key: str, dtype: str = "float32", shape: tuple[int, ...] = (2, 3)) -> VariableSpec:
    return VariableSpec(key, f"{key}/.ATTRIBUTES/VARIABLE_VALUE", dtype, shape)


MANIFEST = Manifest(
    (
        var("kernel", "float32", (4, 3)),  # 48 bytes
        var("bias", "float64", (3,)),  # 24 bytes
        var("step", "int64", ()),  # 8 bytes: a scalar has one element
        var("empty", "uint8", (0, 5)),  # 0 bytes
    )
)


def test_nbytes_of_variables_and_manifest() -> None:
    assert [v.nbytes for v in MANIFEST.variables] == [48, 24, 8, 0]
    assert MANIFEST.nbytes == 80
    assert Manifest(()).nbytes == 0


@pytest.mark.parametrize("dtype", sorted(ITEMSIZE))
def test_nbytes_uses_the_dtype_item_size(dtype: str) -> None:
    assert var("v", dtype, (5, 2)).nbytes == 10 * ITEMSIZE[dtype]


def test_offsets_are_contiguous_in_manifest_order() -> None:
    assert MANIFEST.offsets() == [(0, 48), (48, 72), (72, 80), (80, 80)]


def test_matching_snapshot_passes() -> None:
    MANIFEST.check_snapshot(list(MANIFEST.variables), 80, max_bytes=80)
    # Shapes that arrive as lists (from protobuf) compare by value.
    as_lists = [VariableSpec(v.key, v.checkpoint_key, v.dtype, list(v.shape)) for v in MANIFEST.variables]
    MANIFEST.check_snapshot(as_lists, 80)


def declared_with(index: int, replacement: VariableSpec) -> list[VariableSpec]:
    declared = list(MANIFEST.variables)
    declared[index] = replacement
    return declared


@pytest.mark.parametrize(
    ("declared", "named"),
    [
        (declared_with(1, var("biass", "float64", (3,))), "'biass'"),
        (declared_with(1, var("bias", "float32", (3,))), "'bias'"),
        (declared_with(0, var("kernel", "float32", (3, 4))), "'kernel'"),
        (declared_with(2, var("step", "int64", (1,))), "'step'"),
    ],
    ids=["name", "dtype", "shape", "scalar-vs-vector"],
)
def test_mismatch_names_the_first_offending_variable(declared: list[VariableSpec], named: str) -> None:
    with pytest.raises(InvalidRequestError, match=named):
        MANIFEST.check_snapshot(declared, MANIFEST.nbytes)


def test_swapped_checkpoint_keys_of_same_shape_variables_are_refused() -> None:
    # Two variables alike in dtype and shape: the keys alone tell them apart.
    manifest = Manifest((var("kernel0", "float32", (4, 4)), var("kernel1", "float32", (4, 4))))
    a, b = manifest.variables
    swapped = [
        VariableSpec(a.key, b.checkpoint_key, a.dtype, a.shape),
        VariableSpec(b.key, a.checkpoint_key, b.dtype, b.shape),
    ]
    with pytest.raises(InvalidRequestError) as raised:
        manifest.check_snapshot(swapped, manifest.nbytes)
    message = str(raised.value)
    assert "'kernel0'" in message and "checkpoint_key" in message
    assert repr(a.checkpoint_key) in message and repr(b.checkpoint_key) in message
    assert "'kernel1'" not in message  # the first offender only


def test_only_the_first_of_several_mismatches_is_named() -> None:
    declared = [
        var("kernel", "int32", (4, 3)),
        var("bias", "int32", (3,)),
        *MANIFEST.variables[2:],
    ]

    with pytest.raises(InvalidRequestError) as raised:
        MANIFEST.check_snapshot(declared, MANIFEST.nbytes)

    assert "'kernel'" in str(raised.value)
    assert "'bias'" not in str(raised.value)


def test_wrong_name_message_gives_both_names() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        MANIFEST.check_snapshot(declared_with(0, var("kernal", "float32", (4, 3))), 80)
    assert "'kernal'" in str(raised.value) and "'kernel'" in str(raised.value)


def test_fewer_variables_names_the_first_missing_one() -> None:
    with pytest.raises(InvalidRequestError, match=r"has 2 variables.*has 4.*'step'"):
        MANIFEST.check_snapshot(list(MANIFEST.variables[:2]), 72)


def test_more_variables_names_the_first_extra_one() -> None:
    declared = [*MANIFEST.variables, var("extra"), var("extra2")]

    with pytest.raises(InvalidRequestError, match=r"has 6 variables.*has 4.*'extra'"):
        MANIFEST.check_snapshot(declared, 80 + 48)


@pytest.mark.parametrize("declared_bytes", [0, 79, 81])
def test_declared_bytes_must_match_the_variables(declared_bytes: int) -> None:
    with pytest.raises(InvalidRequestError, match=f"declares {declared_bytes} bytes.*take 80"):
        MANIFEST.check_snapshot(list(MANIFEST.variables), declared_bytes)


def test_snapshot_past_max_bytes_is_limit_exceeded() -> None:
    with pytest.raises(LimitExceededError, match="80 bytes exceeds.*79"):
        MANIFEST.check_snapshot(list(MANIFEST.variables), 80, max_bytes=79)
    # LimitExceeded is a different status from a bad request.
    assert not issubclass(LimitExceededError, InvalidRequestError)


def test_duplicate_keys_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="key 'a' appears twice"):
        Manifest((VariableSpec("a", "ca", "float32", (1,)), VariableSpec("a", "cb", "int8", ())))
    with pytest.raises(InvalidRequestError, match="checkpoint_key 'ca' appears twice"):
        Manifest((VariableSpec("a", "ca", "float32", (1,)), VariableSpec("b", "ca", "int8", ())))


@pytest.mark.parametrize("dtype", ["string", "resource", "variant", "float8", "", "Float32"])
def test_unknown_dtype_is_refused(dtype: str) -> None:
    with pytest.raises(InvalidRequestError, match="dtype"):
        VariableSpec("v", "cv", dtype, (1,))


def test_empty_key_and_negative_dimension_are_refused() -> None:
    with pytest.raises(InvalidRequestError):
        VariableSpec("", "cv", "float32", (1,))
    with pytest.raises(InvalidRequestError):
        VariableSpec("v", "", "float32", (1,))
    with pytest.raises(InvalidRequestError, match="negative"):
        VariableSpec("v", "cv", "float32", (2, -1))
