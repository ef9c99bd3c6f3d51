"""The software versions a save manifest records of the daemon itself.

The trainer's (TensorFlow's, TF-Agents') come with each save
(SaveHeader.trainer_versions) and are recorded beside these: the daemon
runs no TensorFlow.
"""

from __future__ import annotations

from checkpointd import __version__


def recorded() -> dict[str, str]:
    """The daemon's versions recorded in save manifests."""
    return {"checkpointd": __version__}
