"""What the formats that write with TensorFlow's SaveV2 share: the versions a manifest records, and SaveV2 input.

TensorFlow is imported when a function is called, not with this module.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

from checkpointd import __version__
from checkpointd.protocol.wire import ALIGNMENT  # Eigen's: TF wraps memory aligned to it without a copy


@functools.cache
def versions() -> dict[str, str]:
    """Versions recorded in save manifests; tf-agents only if it is installed here."""
    import tensorflow as tf

    versions = {"checkpointd": __version__, "tensorflow": tf.__version__}
    try:
        versions["tf_agents"] = importlib.metadata.version("tf-agents")
    except importlib.metadata.PackageNotFoundError:
        pass
    return versions


# DLPack carries these; others (bfloat16, bool) go through convert_to_tensor.
_DLPACK_DTYPES = frozenset("float16 float32 float64 int8 int16 int32 int64 uint8 uint16 uint32 uint64".split())


def as_input(array: Any) -> Any:
    """`array` as SaveV2 input: a tensor sharing its memory if TF can, else `array`.

    TF copies every NumPy array it converts (a pass over the whole save); DLPack wraps
    one without a copy, but TF aborts the process on memory that is not
    64-byte aligned, so only aligned, writable arrays take that way.
    """
    import tensorflow as tf

    if (
        array.dtype.name in _DLPACK_DTYPES
        and array.flags.writeable
        and array.flags.c_contiguous
        and array.ctypes.data % ALIGNMENT == 0
    ):
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return array
