"""The software versions a save manifest records.

TensorFlow is imported when the function is called, not with this module.
"""

from __future__ import annotations

import functools
import importlib.metadata

from checkpointd import __version__


@functools.cache
def recorded() -> dict[str, str]:
    """Versions recorded in save manifests; tf-agents only if it is installed here."""
    import tensorflow as tf

    found = {"checkpointd": __version__, "tensorflow": tf.__version__}
    try:
        found["tf_agents"] = importlib.metadata.version("tf-agents")
    except importlib.metadata.PackageNotFoundError:
        pass
    return found
