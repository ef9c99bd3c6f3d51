from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SaveKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAVE_KIND_UNSPECIFIED: _ClassVar[SaveKind]
    SAVED_MODEL: _ClassVar[SaveKind]
    CHECKPOINT: _ClassVar[SaveKind]
    TRAINING_CHECKPOINT: _ClassVar[SaveKind]
SAVE_KIND_UNSPECIFIED: SaveKind
SAVED_MODEL: SaveKind
CHECKPOINT: SaveKind
TRAINING_CHECKPOINT: SaveKind

class Variable(_message.Message):
    __slots__ = ("key", "checkpoint_key", "dtype", "shape")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    key: str
    checkpoint_key: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[str] = ..., checkpoint_key: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("path", "offset", "data", "crc32c")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    data: bytes
    crc32c: int
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class RegisterRunHeader(_message.Message):
    __slots__ = ("run", "variables", "checkpoint_object_graph", "template_bytes", "folder", "kind", "checkpoint_dir")
    RUN_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_OBJECT_GRAPH_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    run: str
    variables: _containers.RepeatedCompositeFieldContainer[Variable]
    checkpoint_object_graph: bytes
    template_bytes: int
    folder: str
    kind: SaveKind
    checkpoint_dir: str
    def __init__(self, run: _Optional[str] = ..., variables: _Optional[_Iterable[_Union[Variable, _Mapping]]] = ..., checkpoint_object_graph: _Optional[bytes] = ..., template_bytes: _Optional[int] = ..., folder: _Optional[str] = ..., kind: _Optional[_Union[SaveKind, str]] = ..., checkpoint_dir: _Optional[str] = ...) -> None: ...

class RegisterRunRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: RegisterRunHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[RegisterRunHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class RegisterRunResponse(_message.Message):
    __slots__ = ("run", "variables", "snapshot_bytes", "folder")
    RUN_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    run: str
    variables: _containers.RepeatedCompositeFieldContainer[Variable]
    snapshot_bytes: int
    folder: str
    def __init__(self, run: _Optional[str] = ..., variables: _Optional[_Iterable[_Union[Variable, _Mapping]]] = ..., snapshot_bytes: _Optional[int] = ..., folder: _Optional[str] = ...) -> None: ...

class NumpyStateEntry(_message.Message):
    __slots__ = ("checkpoint_key", "nbytes")
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    checkpoint_key: str
    nbytes: int
    def __init__(self, checkpoint_key: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class NumpyState(_message.Message):
    __slots__ = ("object_graph", "entries")
    OBJECT_GRAPH_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    object_graph: bytes
    entries: _containers.RepeatedCompositeFieldContainer[NumpyStateEntry]
    def __init__(self, object_graph: _Optional[bytes] = ..., entries: _Optional[_Iterable[_Union[NumpyStateEntry, _Mapping]]] = ...) -> None: ...

class SaveHeader(_message.Message):
    __slots__ = ("run", "kind", "export_dir", "blocking", "step", "variables", "snapshot_bytes", "numpy_state", "shared_memory", "training_checkpoint", "held", "local_skips", "incremental", "on_notice", "notice_unix_seconds", "trainer_versions")
    class TrainerVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EXPORT_DIR_FIELD_NUMBER: _ClassVar[int]
    BLOCKING_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUMPY_STATE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    TRAINING_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SKIPS_FIELD_NUMBER: _ClassVar[int]
    INCREMENTAL_FIELD_NUMBER: _ClassVar[int]
    ON_NOTICE_FIELD_NUMBER: _ClassVar[int]
    NOTICE_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    run: str
    kind: SaveKind
    export_dir: str
    blocking: bool
    step: int
    variables: _containers.RepeatedCompositeFieldContainer[Variable]
    snapshot_bytes: int
    numpy_state: NumpyState
    shared_memory: bool
    training_checkpoint: TrainingCheckpoint
    held: HeldSave
    local_skips: _containers.RepeatedCompositeFieldContainer[LocalSkip]
    incremental: bool
    on_notice: bool
    notice_unix_seconds: float
    trainer_versions: _containers.ScalarMap[str, str]
    def __init__(self, run: _Optional[str] = ..., kind: _Optional[_Union[SaveKind, str]] = ..., export_dir: _Optional[str] = ..., blocking: bool = ..., step: _Optional[int] = ..., variables: _Optional[_Iterable[_Union[Variable, _Mapping]]] = ..., snapshot_bytes: _Optional[int] = ..., numpy_state: _Optional[_Union[NumpyState, _Mapping]] = ..., shared_memory: bool = ..., training_checkpoint: _Optional[_Union[TrainingCheckpoint, _Mapping]] = ..., held: _Optional[_Union[HeldSave, _Mapping]] = ..., local_skips: _Optional[_Iterable[_Union[LocalSkip, _Mapping]]] = ..., incremental: bool = ..., on_notice: bool = ..., notice_unix_seconds: _Optional[float] = ..., trainer_versions: _Optional[_Mapping[str, str]] = ...) -> None: ...

class HeldSave(_message.Message):
    __slots__ = ("segment_path", "lock_path")
    SEGMENT_PATH_FIELD_NUMBER: _ClassVar[int]
    LOCK_PATH_FIELD_NUMBER: _ClassVar[int]
    segment_path: str
    lock_path: str
    def __init__(self, segment_path: _Optional[str] = ..., lock_path: _Optional[str] = ...) -> None: ...

class LocalSkip(_message.Message):
    __slots__ = ("kind", "export_dir", "step")
    KIND_FIELD_NUMBER: _ClassVar[int]
    EXPORT_DIR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    kind: SaveKind
    export_dir: str
    step: int
    def __init__(self, kind: _Optional[_Union[SaveKind, str]] = ..., export_dir: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("checkpoint_key", "dtype", "shape", "nbytes")
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    checkpoint_key: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, checkpoint_key: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class TrainingCheckpoint(_message.Message):
    __slots__ = ("object_graph", "tensors", "max_to_keep", "keep_checkpoint_every_n_hours")
    OBJECT_GRAPH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MAX_TO_KEEP_FIELD_NUMBER: _ClassVar[int]
    KEEP_CHECKPOINT_EVERY_N_HOURS_FIELD_NUMBER: _ClassVar[int]
    object_graph: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    max_to_keep: int
    keep_checkpoint_every_n_hours: float
    def __init__(self, object_graph: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., max_to_keep: _Optional[int] = ..., keep_checkpoint_every_n_hours: _Optional[float] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("header", "chunk", "shared_memory_written", "same")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SAME_FIELD_NUMBER: _ClassVar[int]
    header: SaveHeader
    chunk: Chunk
    shared_memory_written: SharedMemoryWritten
    same: SameChunks
    def __init__(self, header: _Optional[_Union[SaveHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., shared_memory_written: _Optional[_Union[SharedMemoryWritten, _Mapping]] = ..., same: _Optional[_Union[SameChunks, _Mapping]] = ...) -> None: ...

class IncrementalBase(_message.Message):
    __slots__ = ("export_dir", "chunk_bytes", "parts")
    EXPORT_DIR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    export_dir: str
    chunk_bytes: int
    parts: _containers.RepeatedCompositeFieldContainer[PartDigests]
    def __init__(self, export_dir: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[PartDigests, _Mapping]]] = ...) -> None: ...

class PartDigests(_message.Message):
    __slots__ = ("chunk_crc32c",)
    CHUNK_CRC32C_FIELD_NUMBER: _ClassVar[int]
    chunk_crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, chunk_crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class SameChunks(_message.Message):
    __slots__ = ("offset", "length", "chunk_crc32c")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CRC32C_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    chunk_crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., chunk_crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class SharedMemory(_message.Message):
    __slots__ = ("path", "size", "offsets", "lock_path")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LOCK_PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    lock_path: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., lock_path: _Optional[str] = ...) -> None: ...

class SharedMemoryWritten(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveDecision(_message.Message):
    __slots__ = ("accepted", "reason", "shared_memory", "base")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    shared_memory: SharedMemory
    base: IncrementalBase
    def __init__(self, accepted: bool = ..., reason: _Optional[str] = ..., shared_memory: _Optional[_Union[SharedMemory, _Mapping]] = ..., base: _Optional[_Union[IncrementalBase, _Mapping]] = ...) -> None: ...

class SaveResult(_message.Message):
    __slots__ = ("path", "bytes_written", "duration_seconds", "step", "kind", "bytes_received", "bytes_copied", "incremental_path")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    INCREMENTAL_PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    bytes_written: int
    duration_seconds: float
    step: int
    kind: SaveKind
    bytes_received: int
    bytes_copied: int
    incremental_path: str
    def __init__(self, path: _Optional[str] = ..., bytes_written: _Optional[int] = ..., duration_seconds: _Optional[float] = ..., step: _Optional[int] = ..., kind: _Optional[_Union[SaveKind, str]] = ..., bytes_received: _Optional[int] = ..., bytes_copied: _Optional[int] = ..., incremental_path: _Optional[str] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("decision", "result")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    decision: SaveDecision
    result: SaveResult
    def __init__(self, decision: _Optional[_Union[SaveDecision, _Mapping]] = ..., result: _Optional[_Union[SaveResult, _Mapping]] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("run", "timeout_seconds", "local_skips")
    RUN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SKIPS_FIELD_NUMBER: _ClassVar[int]
    run: str
    timeout_seconds: float
    local_skips: _containers.RepeatedCompositeFieldContainer[LocalSkip]
    def __init__(self, run: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., local_skips: _Optional[_Iterable[_Union[LocalSkip, _Mapping]]] = ...) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, runs: _Optional[_Iterable[str]] = ...) -> None: ...

class CloseRunRequest(_message.Message):
    __slots__ = ("run", "timeout_seconds")
    RUN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    run: str
    timeout_seconds: float
    def __init__(self, run: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class CloseRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: str
    def __init__(self, run: _Optional[str] = ...) -> None: ...

class WatchStandbyRequest(_message.Message):
    __slots__ = ("run", "slot_paths")
    RUN_FIELD_NUMBER: _ClassVar[int]
    SLOT_PATHS_FIELD_NUMBER: _ClassVar[int]
    run: str
    slot_paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run: _Optional[str] = ..., slot_paths: _Optional[_Iterable[str]] = ...) -> None: ...

class WatchStandbyResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: str
    def __init__(self, run: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("run", "stored")
    RUN_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    run: str
    stored: bool
    def __init__(self, run: _Optional[str] = ..., stored: bool = ...) -> None: ...

class InFlightSave(_message.Message):
    __slots__ = ("kind", "export_dir", "step", "started_unix_seconds", "waiting")
    KIND_FIELD_NUMBER: _ClassVar[int]
    EXPORT_DIR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    kind: SaveKind
    export_dir: str
    step: int
    started_unix_seconds: float
    waiting: int
    def __init__(self, kind: _Optional[_Union[SaveKind, str]] = ..., export_dir: _Optional[str] = ..., step: _Optional[int] = ..., started_unix_seconds: _Optional[float] = ..., waiting: _Optional[int] = ...) -> None: ...

class LastSuccess(_message.Message):
    __slots__ = ("kind", "path", "step", "unix_seconds", "bytes_received", "bytes_copied")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    kind: SaveKind
    path: str
    step: int
    unix_seconds: float
    bytes_received: int
    bytes_copied: int
    def __init__(self, kind: _Optional[_Union[SaveKind, str]] = ..., path: _Optional[str] = ..., step: _Optional[int] = ..., unix_seconds: _Optional[float] = ..., bytes_received: _Optional[int] = ..., bytes_copied: _Optional[int] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run", "state", "in_flight", "saves_ok", "saves_skipped", "saves_failed", "last_success", "last_error", "saves_cancelled")
    RUN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SAVES_OK_FIELD_NUMBER: _ClassVar[int]
    SAVES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    SAVES_FAILED_FIELD_NUMBER: _ClassVar[int]
    LAST_SUCCESS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    SAVES_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    run: str
    state: str
    in_flight: InFlightSave
    saves_ok: int
    saves_skipped: int
    saves_failed: int
    last_success: LastSuccess
    last_error: str
    saves_cancelled: int
    def __init__(self, run: _Optional[str] = ..., state: _Optional[str] = ..., in_flight: _Optional[_Union[InFlightSave, _Mapping]] = ..., saves_ok: _Optional[int] = ..., saves_skipped: _Optional[int] = ..., saves_failed: _Optional[int] = ..., last_success: _Optional[_Union[LastSuccess, _Mapping]] = ..., last_error: _Optional[str] = ..., saves_cancelled: _Optional[int] = ...) -> None: ...

class StoredRun(_message.Message):
    __slots__ = ("folder", "run", "saves", "kind", "export_dir", "step", "unix_seconds", "path", "lease_holder")
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    SAVES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EXPORT_DIR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    LEASE_HOLDER_FIELD_NUMBER: _ClassVar[int]
    folder: str
    run: str
    saves: int
    kind: SaveKind
    export_dir: str
    step: int
    unix_seconds: float
    path: str
    lease_holder: str
    def __init__(self, folder: _Optional[str] = ..., run: _Optional[str] = ..., saves: _Optional[int] = ..., kind: _Optional[_Union[SaveKind, str]] = ..., export_dir: _Optional[str] = ..., step: _Optional[int] = ..., unix_seconds: _Optional[float] = ..., path: _Optional[str] = ..., lease_holder: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("runs", "draining", "stored_runs", "stored_truncated", "stored_folders", "notice_seconds_left")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    STORED_RUNS_FIELD_NUMBER: _ClassVar[int]
    STORED_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STORED_FOLDERS_FIELD_NUMBER: _ClassVar[int]
    NOTICE_SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunStatus]
    draining: bool
    stored_runs: _containers.RepeatedCompositeFieldContainer[StoredRun]
    stored_truncated: bool
    stored_folders: int
    notice_seconds_left: float
    def __init__(self, runs: _Optional[_Iterable[_Union[RunStatus, _Mapping]]] = ..., draining: bool = ..., stored_runs: _Optional[_Iterable[_Union[StoredRun, _Mapping]]] = ..., stored_truncated: bool = ..., stored_folders: _Optional[int] = ..., notice_seconds_left: _Optional[float] = ...) -> None: ...

class LatestRequest(_message.Message):
    __slots__ = ("run", "kind", "folder", "checkpoint_dir")
    RUN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    run: str
    kind: SaveKind
    folder: str
    checkpoint_dir: str
    def __init__(self, run: _Optional[str] = ..., kind: _Optional[_Union[SaveKind, str]] = ..., folder: _Optional[str] = ..., checkpoint_dir: _Optional[str] = ...) -> None: ...

class LatestResponse(_message.Message):
    __slots__ = ("found", "path", "export_dir", "step", "kind", "unix_seconds", "checkpoints")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    EXPORT_DIR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    found: bool
    path: str
    export_dir: str
    step: int
    kind: SaveKind
    unix_seconds: float
    checkpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, found: bool = ..., path: _Optional[str] = ..., export_dir: _Optional[str] = ..., step: _Optional[int] = ..., kind: _Optional[_Union[SaveKind, str]] = ..., unix_seconds: _Optional[float] = ..., checkpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("run", "export_dir")
    RUN_FIELD_NUMBER: _ClassVar[int]
    EXPORT_DIR_FIELD_NUMBER: _ClassVar[int]
    run: str
    export_dir: str
    def __init__(self, run: _Optional[str] = ..., export_dir: _Optional[str] = ...) -> None: ...

class RestoreHeader(_message.Message):
    __slots__ = ("export_dir", "step", "kind", "variables", "snapshot_bytes", "numpy_state", "path", "unix_seconds", "training_checkpoint")
    EXPORT_DIR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUMPY_STATE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    export_dir: str
    step: int
    kind: SaveKind
    variables: _containers.RepeatedCompositeFieldContainer[Variable]
    snapshot_bytes: int
    numpy_state: NumpyState
    path: str
    unix_seconds: float
    training_checkpoint: TrainingCheckpoint
    def __init__(self, export_dir: _Optional[str] = ..., step: _Optional[int] = ..., kind: _Optional[_Union[SaveKind, str]] = ..., variables: _Optional[_Iterable[_Union[Variable, _Mapping]]] = ..., snapshot_bytes: _Optional[int] = ..., numpy_state: _Optional[_Union[NumpyState, _Mapping]] = ..., path: _Optional[str] = ..., unix_seconds: _Optional[float] = ..., training_checkpoint: _Optional[_Union[TrainingCheckpoint, _Mapping]] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: RestoreHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[RestoreHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class FileRange(_message.Message):
    __slots__ = ("path", "offset", "length")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    length: int
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class RestoreFilesRequest(_message.Message):
    __slots__ = ("run", "export_dir", "folder", "ranges", "header_only", "stage")
    RUN_FIELD_NUMBER: _ClassVar[int]
    EXPORT_DIR_FIELD_NUMBER: _ClassVar[int]
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    HEADER_ONLY_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    run: str
    export_dir: str
    folder: str
    ranges: _containers.RepeatedCompositeFieldContainer[FileRange]
    header_only: bool
    stage: bool
    def __init__(self, run: _Optional[str] = ..., export_dir: _Optional[str] = ..., folder: _Optional[str] = ..., ranges: _Optional[_Iterable[_Union[FileRange, _Mapping]]] = ..., header_only: bool = ..., stage: bool = ...) -> None: ...

class RestoreFile(_message.Message):
    __slots__ = ("path", "size", "crc32c", "device", "inode", "mtime_ns")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    crc32c: int
    device: int
    inode: int
    mtime_ns: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., crc32c: _Optional[int] = ..., device: _Optional[int] = ..., inode: _Optional[int] = ..., mtime_ns: _Optional[int] = ...) -> None: ...

class RestoreFilesHeader(_message.Message):
    __slots__ = ("export_dir", "step", "kind", "path", "unix_seconds", "files", "local_dir", "payload_bytes", "staging_dir", "staging_device", "staging_inode")
    EXPORT_DIR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_DIR_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGING_DIR_FIELD_NUMBER: _ClassVar[int]
    STAGING_DEVICE_FIELD_NUMBER: _ClassVar[int]
    STAGING_INODE_FIELD_NUMBER: _ClassVar[int]
    export_dir: str
    step: int
    kind: SaveKind
    path: str
    unix_seconds: float
    files: _containers.RepeatedCompositeFieldContainer[RestoreFile]
    local_dir: str
    payload_bytes: int
    staging_dir: str
    staging_device: int
    staging_inode: int
    def __init__(self, export_dir: _Optional[str] = ..., step: _Optional[int] = ..., kind: _Optional[_Union[SaveKind, str]] = ..., path: _Optional[str] = ..., unix_seconds: _Optional[float] = ..., files: _Optional[_Iterable[_Union[RestoreFile, _Mapping]]] = ..., local_dir: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., staging_dir: _Optional[str] = ..., staging_device: _Optional[int] = ..., staging_inode: _Optional[int] = ...) -> None: ...

class StagedFiles(_message.Message):
    __slots__ = ("dir", "paths")
    DIR_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    dir: str
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, dir: _Optional[str] = ..., paths: _Optional[_Iterable[str]] = ...) -> None: ...

class RestoreFilesResponse(_message.Message):
    __slots__ = ("header", "chunk", "staged")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    header: RestoreFilesHeader
    chunk: Chunk
    staged: StagedFiles
    def __init__(self, header: _Optional[_Union[RestoreFilesHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., staged: _Optional[_Union[StagedFiles, _Mapping]] = ...) -> None: ...
