"""`python -m checkpointd` runs the CLI."""

import sys

from checkpointd.cli import main

sys.exit(main())
