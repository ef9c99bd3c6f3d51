"""CRC32C of a concatenation from its pieces' CRCs: `checkpointd.core.crc_combine`, where the use cases reach it too."""

from __future__ import annotations

from checkpointd.core.crc_combine import combine

__all__ = ["combine"]
