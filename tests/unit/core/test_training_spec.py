"""A training checkpoint's own description, checked before the decision (core.checkpoint_spec)."""

from __future__ import annotations

import math

import pytest

from checkpointd.core.checkpoint_spec import CheckpointRetention, CheckpointSpec, TensorSpec, check_dtypes, check_keys
from checkpointd.protocol.errors import InvalidRequestError, LimitExceededError

K = "agent/w/.ATTRIBUTES/VARIABLE_VALUE"
P = "metric/_np_state/x/.ATTRIBUTES/py_state"


def test_numeric_tensors_take_their_shape_s_bytes_and_strings_any_length() -> None:
    assert TensorSpec(K, "float32", (3, 4), 48).nbytes == 48
    assert TensorSpec(P, "string", (), 129).nbytes == 129
    assert TensorSpec(K, "int64", (0, 5), 0).nbytes == 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (("", "float32", (1,), 4), "empty checkpoint_key"),
        (("_CHECKPOINTABLE_OBJECT_GRAPH", "string", (), 3), "object graph's own key"),
        ((K, "float32", (3, 4), 47), "its nbytes says 47"),
        ((K, "resource", (), 8), "dtype 'resource'"),
        ((K, "string", (2,), 8), "only scalar strings"),
        ((K, "float32", (-1,), 0), "negative dimension"),
        ((P, "string", (), -1), "negative size"),
    ],
)
def test_a_tensor_that_does_not_add_up_is_refused(spec: tuple, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        TensorSpec(*spec)


def test_a_spec_refuses_a_repeated_key_and_an_empty_graph() -> None:
    t = TensorSpec(K, "float32", (1,), 4)
    with pytest.raises(InvalidRequestError, match="appears twice"):
        CheckpointSpec(b"g", (t, t))
    with pytest.raises(InvalidRequestError, match="object graph is empty"):
        CheckpointSpec(b"", (t,))


def test_the_declared_size_must_be_the_tensors_and_within_the_limit() -> None:
    spec = CheckpointSpec(b"g", (TensorSpec(K, "float32", (4,), 16), TensorSpec(P, "string", (), 10)))
    spec.check(26, 26)
    with pytest.raises(InvalidRequestError, match="tensors take 26"):
        spec.check(25, None)
    with pytest.raises(LimitExceededError, match="--max-snapshot-bytes"):
        spec.check(26, 25)


def test_declared_tensors_must_be_exactly_the_graph_s_attributes_naming_the_first_difference() -> None:
    graph = [(K, "VARIABLE_VALUE"), (P, "py_state")]
    check_keys([P, K], graph)  # any order
    with pytest.raises(InvalidRequestError, match="'extra' is not in the object graph"):
        check_keys([K, P, "extra"], graph)
    with pytest.raises(InvalidRequestError, match=f"the object graph has '{P}', which no tensor declares"):
        check_keys([K], graph)
    with pytest.raises(InvalidRequestError, match="names 'a' twice"):
        check_keys(["a"], [("a", "VARIABLE_VALUE"), ("a", "VARIABLE_VALUE")])


def test_python_state_must_be_a_string_tensor() -> None:
    graph = [(P, "py_state")]
    check_dtypes(CheckpointSpec(b"g", (TensorSpec(P, "string", (), 3),)), graph)
    with pytest.raises(InvalidRequestError, match="must be a 'string', not 'float32'"):
        check_dtypes(CheckpointSpec(b"g", (TensorSpec(P, "float32", (1,), 4),)), graph)


@pytest.mark.parametrize(
    ("wire", "rules"),
    [
        ((0, 0.0), CheckpointRetention(None, None)),
        ((3, 0.0), CheckpointRetention(3, None)),
        ((1, 2.5), CheckpointRetention(1, 2.5)),
    ],
)
def test_retention_from_the_wire_reads_zero_as_none(wire: tuple[int, float], rules: CheckpointRetention) -> None:
    assert CheckpointRetention.from_wire(*wire) == rules


@pytest.mark.parametrize("hours", [-1.0, math.nan, math.inf])
def test_retention_refuses_hours_that_are_not_a_positive_number(hours: float) -> None:
    with pytest.raises(InvalidRequestError, match="keep_checkpoint_every_n_hours"):
        CheckpointRetention.from_wire(1, hours)
