"""What a variable is on the wire and in TensorFlow's checkpoints, by name and size.

Both sides name variables and dtypes the same way: the dtypes a snapshot may
carry and their item sizes (NumPy names, `tf.DType.name` spells them alike),
the suffix TensorFlow appends to a variable's object path to make its
checkpoint key, and the key of the serialized object graph every TF2
checkpoint holds beside its tensors. Stdlib only, so the daemon's pure core
sizes snapshots with the same table the client checks its variables against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Item sizes of the dtypes a snapshot may carry. Strings and resources have
# no fixed size: the client refuses them and so does registration.
ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}

# The checkpoint entry that holds the serialized TrackableObjectGraph.
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
# A RegisterRun template's copy of its SavedModel checkpoint's OBJECT_GRAPH_KEY
# tensor, raw, sent with variables/variables.index in place of the data shards
# (whose values every save overwrites): see checkpointd.formats.policy_template.
TEMPLATE_OBJECT_GRAPH = "variables/object_graph.pb"
# A variable's attribute in the object graph, and the key suffix it gives:
# a variable at object path `a/b` is stored as `a/b/.ATTRIBUTES/VARIABLE_VALUE`.
VARIABLE_ATTRIBUTE = "VARIABLE_VALUE"
VARIABLE_SUFFIX = f"/.ATTRIBUTES/{VARIABLE_ATTRIBUTE}"
# A training checkpoint's tensors may also be scalar strings: what TensorFlow
# writes for Python state (attribute "py_state", e.g. a NumpyState array's
# .npy bytes). Their size is their length, not a product of a shape.
STRING = "string"
PY_STATE_ATTRIBUTE = "py_state"


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    """The bytes of one variable's value; KeyError for a dtype not in ITEMSIZE."""
    return math.prod(shape) * ITEMSIZE[dtype]


def is_string(dtype: str) -> bool:
    """Whether a training checkpoint's tensor of `dtype` is a scalar string."""
    return dtype == STRING
