"""`checkpointd serve|flush|status|close|verify`: the entry point."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from checkpointd.cli.parse import FetchCommand, VerifyCommand, config_from_args
from checkpointd.core.config import ServeConfig


def main(argv: Sequence[str] | None = None) -> int:
    """The `checkpointd` entry point."""
    command, level = config_from_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if isinstance(command, ServeConfig):
        from checkpointd.cli.serve import serve  # grpc, and the daemon's modules

        return serve(command)
    if isinstance(command, VerifyCommand):
        from checkpointd.cli import verify  # stdlib and crc32c only

        if command.urls:  # boto3 only for an object store
            from checkpointd.cli import fetch

            code = fetch.verify(
                command.urls, endpoint_url=command.s3_endpoint_url, region=command.s3_region, as_json=command.as_json
            )
            if not command.paths:
                return code
            return max(code, verify.run(command.paths, as_json=command.as_json, progress=command.progress))
        return verify.run(command.paths, as_json=command.as_json, progress=command.progress)
    if isinstance(command, FetchCommand):
        from checkpointd.cli import fetch

        return fetch.fetch(
            command.root,
            command.save,
            command.dest,
            endpoint_url=command.s3_endpoint_url,
            region=command.s3_region,
            progress=command.progress,
        )
    from checkpointd.cli import ops  # grpc stubs only; no TensorFlow

    return ops.run(command)


if __name__ == "__main__":
    sys.exit(main())
