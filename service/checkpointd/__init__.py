"""checkpointd: an asynchronous checkpoint service for TF-Agents (the daemon)."""

__version__ = "0.1.0"

__all__ = ["__version__"]
