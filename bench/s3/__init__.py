"""Section 8, saves committed to S3: the section (section.py), its baselines, report and the request probe.

`python -m bench.s3` runs section.py's worker process; the bench's run
imports the section's face from here.
"""

from bench.s3.section import add_arguments, delete_prefix, mode, run_section

__all__ = ["add_arguments", "delete_prefix", "mode", "run_section"]
