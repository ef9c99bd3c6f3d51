"""`python -m bench.s3 --size SIZE ...`: the S3 section's worker process (section.py's command line)."""

import sys

from bench.s3.section import main

sys.exit(main())
