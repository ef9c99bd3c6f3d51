"""What the trainer tells the daemon about itself: its TensorFlow and TF-Agents versions.

The daemon runs no TensorFlow, so a save's manifest records the versions of
the trainer that made it: every Save header carries them
(`SaveHeader.trainer_versions`, set where the one Save call starts,
`checkpointd_client.transport.stream`). The template's fingerprint is the trainer's
too: `tf.saved_model.save` writes `fingerprint.pb` (TensorFlow's
`CreateFingerprintDef`) at the export, and the upload carries it with the
other files (`checkpointd_client.template`).
"""

from __future__ import annotations

import functools
import importlib.metadata

import tensorflow as tf


@functools.cache
def versions() -> dict[str, str]:
    """{"tensorflow": ..., "tf_agents": ...}: tf_agents only where it is installed."""
    found = {"tensorflow": tf.__version__}
    try:
        found["tf_agents"] = importlib.metadata.version("tf-agents")
    except importlib.metadata.PackageNotFoundError:
        pass
    return found
