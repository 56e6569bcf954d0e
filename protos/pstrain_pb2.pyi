from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    SYNC: _ClassVar[Mode]
    SSP: _ClassVar[Mode]
    ASYNC: _ClassVar[Mode]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType
MODE_UNSPECIFIED: Mode
SYNC: Mode
SSP: Mode
ASYNC: Mode

class Initializer(_message.Message):
    __slots__ = ("kind", "a", "b")
    KIND_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    kind: str
    a: float
    b: float
    def __init__(self, kind: _Optional[str] = ..., a: _Optional[float] = ..., b: _Optional[float] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    params: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., params: _Optional[_Mapping[str, float]] = ...) -> None: ...

class DenseSpec(_message.Message):
    __slots__ = ("shape", "dtype", "init", "seed")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    init: Initializer
    seed: int
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., init: _Optional[_Union[Initializer, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class SparseSpec(_message.Message):
    __slots__ = ("dim", "dtype", "init", "seed", "admit", "admit_default", "ttl_clocks", "ttl_s", "max_rows")
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    ADMIT_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    TTL_CLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    dim: int
    dtype: DType
    init: Initializer
    seed: int
    admit: str
    admit_default: float
    ttl_clocks: int
    ttl_s: float
    max_rows: int
    def __init__(self, dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., init: _Optional[_Union[Initializer, _Mapping]] = ..., seed: _Optional[int] = ..., admit: _Optional[str] = ..., admit_default: _Optional[float] = ..., ttl_clocks: _Optional[int] = ..., ttl_s: _Optional[float] = ..., max_rows: _Optional[int] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "dense", "sparse", "optimizer", "allow_non_finite", "consistency", "staleness")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dense: DenseSpec
    sparse: SparseSpec
    optimizer: OptimizerSpec
    allow_non_finite: bool
    consistency: Mode
    staleness: int
    def __init__(self, name: _Optional[str] = ..., dense: _Optional[_Union[DenseSpec, _Mapping]] = ..., sparse: _Optional[_Union[SparseSpec, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., allow_non_finite: _Optional[bool] = ..., consistency: _Optional[_Union[Mode, str]] = ..., staleness: _Optional[int] = ...) -> None: ...

class DeclareTablesRequest(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ...) -> None: ...

class TablePlacement(_message.Message):
    __slots__ = ("name", "row_start", "row_end")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    name: str
    row_start: int
    row_end: int
    def __init__(self, name: _Optional[str] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ...) -> None: ...

class DeclareTablesResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TablePlacement]
    def __init__(self, tables: _Optional[_Iterable[_Union[TablePlacement, _Mapping]]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("duplicate", "elements", "dropped", "kept")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    elements: int
    dropped: bool
    kept: bool
    def __init__(self, duplicate: _Optional[bool] = ..., elements: _Optional[int] = ..., dropped: _Optional[bool] = ..., kept: _Optional[bool] = ...) -> None: ...

class WorkerClock(_message.Message):
    __slots__ = ("worker", "clock", "live")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    worker: int
    clock: int
    live: bool
    def __init__(self, worker: _Optional[int] = ..., clock: _Optional[int] = ..., live: _Optional[bool] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("worker", "incarnation", "generation")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    worker: int
    incarnation: int
    generation: int
    def __init__(self, worker: _Optional[int] = ..., incarnation: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("clock", "open_clock", "live", "position")
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    OPEN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    clock: int
    open_clock: int
    live: bool
    position: str
    def __init__(self, clock: _Optional[int] = ..., open_clock: _Optional[int] = ..., live: _Optional[bool] = ..., position: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("checkpoint_id", "sha256", "generation")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    sha256: str
    generation: int
    def __init__(self, checkpoint_id: _Optional[str] = ..., sha256: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("clock",)
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    clock: int
    def __init__(self, clock: _Optional[int] = ...) -> None: ...

class MembershipRequest(_message.Message):
    __slots__ = ("live_workers", "fenced")
    class FencedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    live_workers: _containers.RepeatedScalarFieldContainer[int]
    fenced: _containers.ScalarMap[int, int]
    def __init__(self, live_workers: _Optional[_Iterable[int]] = ..., fenced: _Optional[_Mapping[int, int]] = ...) -> None: ...

class MembershipResponse(_message.Message):
    __slots__ = ("open_clock", "clocks")
    OPEN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    CLOCKS_FIELD_NUMBER: _ClassVar[int]
    open_clock: int
    clocks: _containers.RepeatedCompositeFieldContainer[WorkerClock]
    def __init__(self, open_clock: _Optional[int] = ..., clocks: _Optional[_Iterable[_Union[WorkerClock, _Mapping]]] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("shard", "num_shards", "incarnation", "job", "version", "max_message_bytes", "chunk_bytes", "workers", "backups", "staleness", "open_clock", "consistency")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    OPEN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    shard: int
    num_shards: int
    incarnation: int
    job: str
    version: str
    max_message_bytes: int
    chunk_bytes: int
    workers: int
    backups: int
    staleness: int
    open_clock: int
    consistency: Mode
    def __init__(self, shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., incarnation: _Optional[int] = ..., job: _Optional[str] = ..., version: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., workers: _Optional[int] = ..., backups: _Optional[int] = ..., staleness: _Optional[int] = ..., open_clock: _Optional[int] = ..., consistency: _Optional[_Union[Mode, str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("pull_log", "history")
    PULL_LOG_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    pull_log: bool
    history: bool
    def __init__(self, pull_log: _Optional[bool] = ..., history: _Optional[bool] = ...) -> None: ...

class ClockRecord(_message.Message):
    __slots__ = ("clock", "workers", "dropped")
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    clock: int
    workers: int
    dropped: int
    def __init__(self, clock: _Optional[int] = ..., workers: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class PullRecord(_message.Message):
    __slots__ = ("table", "worker", "clock", "min_live_clock")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    MIN_LIVE_CLOCK_FIELD_NUMBER: _ClassVar[int]
    table: str
    worker: int
    clock: int
    min_live_clock: int
    def __init__(self, table: _Optional[str] = ..., worker: _Optional[int] = ..., clock: _Optional[int] = ..., min_live_clock: _Optional[int] = ...) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("name", "kind", "optimizer", "rows", "value_bytes", "state_bytes", "index_bytes", "pushes_applied", "pushes_duplicate", "pushes_rejected", "pulls", "rows_pulled", "rows_pushed", "row_start", "row_end", "pushes_dropped", "gradients_aggregated", "consistency", "staleness", "pushes_kept", "memory_bytes", "admitted", "refused_by_admission", "evicted", "readmitted", "metadata_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VALUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    ROWS_PULLED_FIELD_NUMBER: _ClassVar[int]
    ROWS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_AGGREGATED_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_KEPT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_BY_ADMISSION_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    READMITTED_FIELD_NUMBER: _ClassVar[int]
    METADATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    optimizer: str
    rows: int
    value_bytes: int
    state_bytes: int
    index_bytes: int
    pushes_applied: int
    pushes_duplicate: int
    pushes_rejected: int
    pulls: int
    rows_pulled: int
    rows_pushed: int
    row_start: int
    row_end: int
    pushes_dropped: int
    gradients_aggregated: int
    consistency: Mode
    staleness: int
    pushes_kept: int
    memory_bytes: int
    admitted: int
    refused_by_admission: int
    evicted: int
    readmitted: int
    metadata_bytes: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., optimizer: _Optional[str] = ..., rows: _Optional[int] = ..., value_bytes: _Optional[int] = ..., state_bytes: _Optional[int] = ..., index_bytes: _Optional[int] = ..., pushes_applied: _Optional[int] = ..., pushes_duplicate: _Optional[int] = ..., pushes_rejected: _Optional[int] = ..., pulls: _Optional[int] = ..., rows_pulled: _Optional[int] = ..., rows_pushed: _Optional[int] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ..., pushes_dropped: _Optional[int] = ..., gradients_aggregated: _Optional[int] = ..., consistency: _Optional[_Union[Mode, str]] = ..., staleness: _Optional[int] = ..., pushes_kept: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., admitted: _Optional[int] = ..., refused_by_admission: _Optional[int] = ..., evicted: _Optional[int] = ..., readmitted: _Optional[int] = ..., metadata_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("info", "tables", "bytes_received", "bytes_sent", "open_clock", "clocks_closed", "clocks", "pull_log", "history")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    OPEN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    CLOCKS_CLOSED_FIELD_NUMBER: _ClassVar[int]
    CLOCKS_FIELD_NUMBER: _ClassVar[int]
    PULL_LOG_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    info: ServerInfo
    tables: _containers.RepeatedCompositeFieldContainer[TableStats]
    bytes_received: int
    bytes_sent: int
    open_clock: int
    clocks_closed: int
    clocks: _containers.RepeatedCompositeFieldContainer[WorkerClock]
    pull_log: _containers.RepeatedCompositeFieldContainer[PullRecord]
    history: _containers.RepeatedCompositeFieldContainer[ClockRecord]
    def __init__(self, info: _Optional[_Union[ServerInfo, _Mapping]] = ..., tables: _Optional[_Iterable[_Union[TableStats, _Mapping]]] = ..., bytes_received: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., open_clock: _Optional[int] = ..., clocks_closed: _Optional[int] = ..., clocks: _Optional[_Iterable[_Union[WorkerClock, _Mapping]]] = ..., pull_log: _Optional[_Iterable[_Union[PullRecord, _Mapping]]] = ..., history: _Optional[_Iterable[_Union[ClockRecord, _Mapping]]] = ...) -> None: ...

class TransportOffer(_message.Message):
    __slots__ = ("name", "available", "reason", "host", "pid", "address", "detail", "token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    available: bool
    reason: str
    host: str
    pid: int
    address: bytes
    detail: str
    token: str
    def __init__(self, name: _Optional[str] = ..., available: _Optional[bool] = ..., reason: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., address: _Optional[bytes] = ..., detail: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("worker", "incarnation", "offers", "forced", "end_session")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    END_SESSION_FIELD_NUMBER: _ClassVar[int]
    worker: int
    incarnation: int
    offers: _containers.RepeatedCompositeFieldContainer[TransportOffer]
    forced: str
    end_session: int
    def __init__(self, worker: _Optional[int] = ..., incarnation: _Optional[int] = ..., offers: _Optional[_Iterable[_Union[TransportOffer, _Mapping]]] = ..., forced: _Optional[str] = ..., end_session: _Optional[int] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("transport", "session", "offers", "note", "lane")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    transport: str
    session: int
    offers: _containers.RepeatedCompositeFieldContainer[TransportOffer]
    note: str
    lane: str
    def __init__(self, transport: _Optional[str] = ..., session: _Optional[int] = ..., offers: _Optional[_Iterable[_Union[TransportOffer, _Mapping]]] = ..., note: _Optional[str] = ..., lane: _Optional[str] = ...) -> None: ...

class BulkRef(_message.Message):
    __slots__ = ("session", "segment", "fd", "segment_bytes", "offset", "length", "tag")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    session: int
    segment: int
    fd: int
    segment_bytes: int
    offset: int
    length: int
    tag: int
    def __init__(self, session: _Optional[int] = ..., segment: _Optional[int] = ..., fd: _Optional[int] = ..., segment_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., tag: _Optional[int] = ...) -> None: ...

class Span(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ExchangePush(_message.Message):
    __slots__ = ("table", "seq", "dtype", "dim", "shape", "keys", "values", "dense", "assign", "if_absent")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    IF_ABSENT_FIELD_NUMBER: _ClassVar[int]
    table: str
    seq: int
    dtype: DType
    dim: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    keys: Span
    values: Span
    dense: bool
    assign: bool
    if_absent: bool
    def __init__(self, table: _Optional[str] = ..., seq: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., dim: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., keys: _Optional[_Union[Span, _Mapping]] = ..., values: _Optional[_Union[Span, _Mapping]] = ..., dense: _Optional[bool] = ..., assign: _Optional[bool] = ..., if_absent: _Optional[bool] = ...) -> None: ...

class ExchangePull(_message.Message):
    __slots__ = ("table", "keys", "dense")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: Span
    dense: bool
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[_Union[Span, _Mapping]] = ..., dense: _Optional[bool] = ...) -> None: ...

class ExchangeRequest(_message.Message):
    __slots__ = ("worker", "incarnation", "generation", "wait_ms", "push_clock", "pushes", "end_iteration", "pull_clock", "pulls", "payload", "bulk", "answer", "position", "cut", "cut_clock", "acked_clock")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    PUSH_CLOCK_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    END_ITERATION_FIELD_NUMBER: _ClassVar[int]
    PULL_CLOCK_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    CUT_CLOCK_FIELD_NUMBER: _ClassVar[int]
    ACKED_CLOCK_FIELD_NUMBER: _ClassVar[int]
    worker: int
    incarnation: int
    generation: int
    wait_ms: int
    push_clock: int
    pushes: _containers.RepeatedCompositeFieldContainer[ExchangePush]
    end_iteration: bool
    pull_clock: int
    pulls: _containers.RepeatedCompositeFieldContainer[ExchangePull]
    payload: bytes
    bulk: BulkRef
    answer: BulkRef
    position: str
    cut: str
    cut_clock: int
    acked_clock: int
    def __init__(self, worker: _Optional[int] = ..., incarnation: _Optional[int] = ..., generation: _Optional[int] = ..., wait_ms: _Optional[int] = ..., push_clock: _Optional[int] = ..., pushes: _Optional[_Iterable[_Union[ExchangePush, _Mapping]]] = ..., end_iteration: _Optional[bool] = ..., pull_clock: _Optional[int] = ..., pulls: _Optional[_Iterable[_Union[ExchangePull, _Mapping]]] = ..., payload: _Optional[bytes] = ..., bulk: _Optional[_Union[BulkRef, _Mapping]] = ..., answer: _Optional[_Union[BulkRef, _Mapping]] = ..., position: _Optional[str] = ..., cut: _Optional[str] = ..., cut_clock: _Optional[int] = ..., acked_clock: _Optional[int] = ...) -> None: ...

class ExchangePulled(_message.Message):
    __slots__ = ("dtype", "shape", "values")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    values: Span
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., values: _Optional[_Union[Span, _Mapping]] = ...) -> None: ...

class ExchangeResponse(_message.Message):
    __slots__ = ("pushes", "open_clock", "pulled", "payload", "in_bulk", "cut")
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    OPEN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    IN_BULK_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    pushes: _containers.RepeatedCompositeFieldContainer[PushResponse]
    open_clock: int
    pulled: _containers.RepeatedCompositeFieldContainer[ExchangePulled]
    payload: bytes
    in_bulk: bool
    cut: str
    def __init__(self, pushes: _Optional[_Iterable[_Union[PushResponse, _Mapping]]] = ..., open_clock: _Optional[int] = ..., pulled: _Optional[_Iterable[_Union[ExchangePulled, _Mapping]]] = ..., payload: _Optional[bytes] = ..., in_bulk: _Optional[bool] = ..., cut: _Optional[str] = ...) -> None: ...

class ExchangePart(_message.Message):
    __slots__ = ("request", "payload_bytes", "offset", "payload")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    request: ExchangeRequest
    payload_bytes: int
    offset: int
    payload: bytes
    def __init__(self, request: _Optional[_Union[ExchangeRequest, _Mapping]] = ..., payload_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class ExchangeAnswerPart(_message.Message):
    __slots__ = ("response", "payload_bytes", "offset", "payload")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    response: ExchangeResponse
    payload_bytes: int
    offset: int
    payload: bytes
    def __init__(self, response: _Optional[_Union[ExchangeResponse, _Mapping]] = ..., payload_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class LaneHello(_message.Message):
    __slots__ = ("session", "token")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    session: int
    token: str
    def __init__(self, session: _Optional[int] = ..., token: _Optional[str] = ...) -> None: ...

class LaneStatus(_message.Message):
    __slots__ = ("code", "details", "marks")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    MARKS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    marks: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., marks: _Optional[_Iterable[str]] = ...) -> None: ...
