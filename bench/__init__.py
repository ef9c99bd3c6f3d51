"""checkpointd's benchmark: in-process savers, the daemon and the machine's limits, side by side.

Run it from the repository root: `python -m bench` (full, about 25 minutes on
2 cores with the S3 and fleet-scale sections) or `python -m bench --quick`
(small policy only, about a minute).
See `python -m bench --help`.
"""

from bench.config import SIZES, BenchConfig, Size

__all__ = ["SIZES", "BenchConfig", "Size"]
