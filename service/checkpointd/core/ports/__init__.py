"""What the core and the save pipeline need from the outside world, as Protocols, one module per seam.

The two seams a new backend or save kind plugs into:
- `Store` (`storage`): where committed saves live.
- `SaveFormat` (`formats`): how one kind of save is checked, written and read.
Beside them: a save's sink (`sinks`), what Restore needs (`restore`), who
writes a run in a fleet (`leases`), the counters (`metrics`) and the values
that cross them (`records`). A capability only some implementations offer is
a Protocol of its own (`StreamingStore`, `RemoteBases`, `Closing`,
`LocalCopies`, `HeldSaves`, `SaveFiles`, `SegmentLayouts`, `StagesFiles`, `CheckpointValues`, `WatchedSink`,
`ReferencingSink`, `WholePartsSink`, `ImageSink`, `OrderedSink`, `CopyingSink`,
`SameChunksSink`, `LeaseHolders`, `Described`, `TidiesLater`, `BoundedRequests`), checked with isinstance, never
probed with getattr. `checkpointd.server` picks the implementations.
"""

from checkpointd.core.ports.formats import SaveFormat, SegmentLayouts
from checkpointd.core.ports.leases import Described, LeaseHolders, Leases, NoLeases
from checkpointd.core.ports.metrics import (
    Clock,
    LeaseSink,
    MetricsSink,
    NullLeaseSink,
    NullPhases,
    NullSink,
    PhaseSink,
)
from checkpointd.core.ports.records import CommittedSave, SavedFile, SaveMeta, SnapshotBytes, Staged
from checkpointd.core.ports.restore import (
    CheckpointValues,
    HeldSaves,
    LocalCopies,
    SaveFiles,
    SaveValues,
    StagesFiles,
)
from checkpointd.core.ports.sinks import (
    CopyingSink,
    ImageSink,
    OrderedSink,
    ReferencingSink,
    SameChunksSink,
    SaveSink,
    WatchedSink,
    WholePartsSink,
)
from checkpointd.core.ports.storage import (
    BoundedRequests,
    Closing,
    RemoteBases,
    Store,
    StreamingStore,
    TidiesLater,
)

__all__ = [
    "BoundedRequests",
    "CheckpointValues",
    "Clock",
    "Closing",
    "CommittedSave",
    "CopyingSink",
    "Described",
    "HeldSaves",
    "ImageSink",
    "LeaseHolders",
    "LeaseSink",
    "Leases",
    "LocalCopies",
    "MetricsSink",
    "NoLeases",
    "NullLeaseSink",
    "NullPhases",
    "NullSink",
    "OrderedSink",
    "PhaseSink",
    "ReferencingSink",
    "RemoteBases",
    "SameChunksSink",
    "SaveFiles",
    "SaveFormat",
    "SaveMeta",
    "SaveSink",
    "SaveValues",
    "SegmentLayouts",
    "SavedFile",
    "SnapshotBytes",
    "Staged",
    "StagesFiles",
    "Store",
    "StreamingStore",
    "TidiesLater",
    "WatchedSink",
    "WholePartsSink",
]
