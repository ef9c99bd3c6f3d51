"""`python -m bench.fleet template DIR` and `python -m bench.fleet clients ...`: section.py's command line."""

import sys

from bench.fleet.section import main

sys.exit(main())
