"""The `checkpointd` command line: parse (pure), serve, ops, verify."""

from checkpointd.cli.main import main
from checkpointd.cli.parse import OpsCommand, VerifyCommand, config_from_args

__all__ = ["OpsCommand", "VerifyCommand", "config_from_args", "main"]
