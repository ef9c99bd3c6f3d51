"""TensorFlow's tensor bundle without TensorFlow: written, read back, and streamed into as a save lands.

The writer (`checkpointd.bundle.writer`) and the reader
(`checkpointd.bundle.reader`) are the public face; the index's table
(`table`), the chunk digests of an incremental save (`chunks`) and the sink a
save is written through as it arrives (`sink`) are modules of their own.
"""

from checkpointd.bundle.reader import BundleReader, CorruptBundleError, Tensor, UnreadableBundleError, dtype_name
from checkpointd.bundle.writer import (
    DATA_SUFFIX,
    DATA_TYPES,
    HEADER,
    INDEX_SUFFIX,
    BundleWriter,
    Entry,
    check_entries,
    entry_proto,
    string_entry,
    string_size,
    write,
)

__all__ = [
    "DATA_SUFFIX",
    "DATA_TYPES",
    "HEADER",
    "INDEX_SUFFIX",
    "BundleReader",
    "BundleWriter",
    "CorruptBundleError",
    "Entry",
    "Tensor",
    "UnreadableBundleError",
    "check_entries",
    "dtype_name",
    "entry_proto",
    "string_entry",
    "string_size",
    "write",
]
