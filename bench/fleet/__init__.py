"""Section 9, fan-in at fleet scale: the section (section.py) and its parts (clients, phase, store, report).

`python -m bench.fleet` runs section.py's command line (the template and the
client processes); the bench's run imports the section's face from here.
"""

from bench.fleet.section import add_arguments, mode, run_section

__all__ = ["add_arguments", "mode", "run_section"]
