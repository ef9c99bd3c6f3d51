"""`checkpointd serve|flush|status|close|verify`: the entry point."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from checkpointd.cli.parse import VerifyCommand, config_from_args
from checkpointd.core.config import ServeConfig


def main(argv: Sequence[str] | None = None) -> int:
    """The `checkpointd` entry point."""
    command, level = config_from_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if isinstance(command, ServeConfig):
        from checkpointd.cli.serve import serve  # grpc; TensorFlow only once started

        return serve(command)
    if isinstance(command, VerifyCommand):
        from checkpointd.cli import verify  # stdlib and crc32c only

        return verify.run(command.paths, as_json=command.as_json, progress=command.progress)
    from checkpointd.cli import ops  # grpc stubs only; no TensorFlow

    return ops.run(command)


if __name__ == "__main__":
    sys.exit(main())
