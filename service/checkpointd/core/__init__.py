"""The pure core of checkpointd: lanes, manifests, retention choice, config, ports. Stdlib only."""

from checkpointd.core.lane import Failed, Lane, LaneState, SaveSpec, Skipped, Ticket, TicketState, Written
from checkpointd.core.variable_manifest import Manifest, VariableSpec

__all__ = [
    "Failed",
    "Lane",
    "LaneState",
    "Manifest",
    "SaveSpec",
    "Skipped",
    "Ticket",
    "TicketState",
    "VariableSpec",
    "Written",
]
