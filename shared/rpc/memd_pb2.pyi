from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Geometry(_message.Message):
    __slots__ = ("backend", "num_blocks", "block_bytes", "pool_bytes", "block_size", "bytes_per_token", "generation")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    backend: str
    num_blocks: int
    block_bytes: int
    pool_bytes: int
    block_size: int
    bytes_per_token: int
    generation: int
    def __init__(self, backend: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., block_size: _Optional[int] = ..., bytes_per_token: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("name", "pid", "model", "block_size", "bytes_per_token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    pid: int
    model: str
    block_size: int
    bytes_per_token: int
    def __init__(self, name: _Optional[str] = ..., pid: _Optional[int] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., bytes_per_token: _Optional[int] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("worker_id", "geometry", "pool_handle", "lease_timeout_s", "lease")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    POOL_HANDLE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    geometry: Geometry
    pool_handle: bytes
    lease_timeout_s: float
    lease: bytes
    def __init__(self, worker_id: _Optional[int] = ..., geometry: _Optional[_Union[Geometry, _Mapping]] = ..., pool_handle: _Optional[bytes] = ..., lease_timeout_s: _Optional[float] = ..., lease: _Optional[bytes] = ...) -> None: ...

class SessionUp(_message.Message):
    __slots__ = ("worker_id", "goodbye", "lease")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    goodbye: bool
    lease: bytes
    def __init__(self, worker_id: _Optional[int] = ..., goodbye: _Optional[bool] = ..., lease: _Optional[bytes] = ...) -> None: ...

class SessionDown(_message.Message):
    __slots__ = ("event", "seq_id", "reason")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    event: str
    seq_id: int
    reason: str
    def __init__(self, event: _Optional[str] = ..., seq_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("worker_id", "lease", "wanted_blocks", "packed_ops")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    WANTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PACKED_OPS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    lease: bytes
    wanted_blocks: int
    packed_ops: bytes
    def __init__(self, worker_id: _Optional[int] = ..., lease: _Optional[bytes] = ..., wanted_blocks: _Optional[int] = ..., packed_ops: _Optional[bytes] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("free_blocks", "refused", "packed_results")
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    PACKED_RESULTS_FIELD_NUMBER: _ClassVar[int]
    free_blocks: int
    refused: StepRefusal
    packed_results: bytes
    def __init__(self, free_blocks: _Optional[int] = ..., refused: _Optional[_Union[StepRefusal, _Mapping]] = ..., packed_results: _Optional[bytes] = ...) -> None: ...

class StepRefusal(_message.Message):
    __slots__ = ("code", "message", "op_index", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OP_INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    op_index: int
    reason: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., op_index: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("total_blocks", "free_blocks", "used_blocks", "cached_blocks", "block_bytes", "pool_bytes", "workers", "sequences", "counters", "backend", "device", "generation", "uptime_s", "bytes_per_token", "block_size", "swap_total_blocks", "swap_free_blocks", "swapped_blocks", "rpcs", "draining", "cluster", "prefix_blocks")
    class SequencesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RpcsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SWAP_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RPCS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    total_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    block_bytes: int
    pool_bytes: int
    workers: int
    sequences: _containers.ScalarMap[str, int]
    counters: _containers.ScalarMap[str, int]
    backend: str
    device: str
    generation: int
    uptime_s: float
    bytes_per_token: int
    block_size: int
    swap_total_blocks: int
    swap_free_blocks: int
    swapped_blocks: int
    rpcs: _containers.ScalarMap[str, int]
    draining: bool
    cluster: str
    prefix_blocks: int
    def __init__(self, total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., workers: _Optional[int] = ..., sequences: _Optional[_Mapping[str, int]] = ..., counters: _Optional[_Mapping[str, int]] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., generation: _Optional[int] = ..., uptime_s: _Optional[float] = ..., bytes_per_token: _Optional[int] = ..., block_size: _Optional[int] = ..., swap_total_blocks: _Optional[int] = ..., swap_free_blocks: _Optional[int] = ..., swapped_blocks: _Optional[int] = ..., rpcs: _Optional[_Mapping[str, int]] = ..., draining: _Optional[bool] = ..., cluster: _Optional[str] = ..., prefix_blocks: _Optional[int] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("skip_blocks", "state", "worker_id", "packed_blocks")
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    skip_blocks: bool
    state: str
    worker_id: int
    packed_blocks: bool
    def __init__(self, skip_blocks: _Optional[bool] = ..., state: _Optional[str] = ..., worker_id: _Optional[int] = ..., packed_blocks: _Optional[bool] = ...) -> None: ...

class BlockRow(_message.Message):
    __slots__ = ("block_id", "ref_count", "last_access", "seq_ids", "state", "heat", "owners")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    REF_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEAT_FIELD_NUMBER: _ClassVar[int]
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    ref_count: int
    last_access: float
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    state: str
    heat: float
    owners: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_id: _Optional[int] = ..., ref_count: _Optional[int] = ..., last_access: _Optional[float] = ..., seq_ids: _Optional[_Iterable[int]] = ..., state: _Optional[str] = ..., heat: _Optional[float] = ..., owners: _Optional[_Iterable[int]] = ...) -> None: ...

class SeqRow(_message.Message):
    __slots__ = ("seq_id", "session_id", "state", "owner", "num_committed", "num_tokens", "block_ids", "model", "last_access", "heat", "swapped_blocks", "tenant", "retain_until")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_FIELD_NUMBER: _ClassVar[int]
    HEAT_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RETAIN_UNTIL_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    session_id: str
    state: str
    owner: int
    num_committed: int
    num_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    model: str
    last_access: float
    heat: float
    swapped_blocks: int
    tenant: str
    retain_until: float
    def __init__(self, seq_id: _Optional[int] = ..., session_id: _Optional[str] = ..., state: _Optional[str] = ..., owner: _Optional[int] = ..., num_committed: _Optional[int] = ..., num_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ..., last_access: _Optional[float] = ..., heat: _Optional[float] = ..., swapped_blocks: _Optional[int] = ..., tenant: _Optional[str] = ..., retain_until: _Optional[float] = ...) -> None: ...

class WorkerRow(_message.Message):
    __slots__ = ("worker_id", "name", "pid", "model", "block_size", "last_seen", "running", "draining")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    name: str
    pid: int
    model: str
    block_size: int
    last_seen: float
    running: int
    draining: bool
    def __init__(self, worker_id: _Optional[int] = ..., name: _Optional[str] = ..., pid: _Optional[int] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., last_seen: _Optional[float] = ..., running: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class SnapshotReply(_message.Message):
    __slots__ = ("taken_at", "block_bytes", "blocks", "sequences", "workers", "generation", "packed_blocks")
    TAKEN_AT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PACKED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    taken_at: float
    block_bytes: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRow]
    sequences: _containers.RepeatedCompositeFieldContainer[SeqRow]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerRow]
    generation: int
    packed_blocks: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, taken_at: _Optional[float] = ..., block_bytes: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockRow, _Mapping]]] = ..., sequences: _Optional[_Iterable[_Union[SeqRow, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerRow, _Mapping]]] = ..., generation: _Optional[int] = ..., packed_blocks: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("seq_id", "session_id", "idle_s", "blocks", "worker_id", "mode")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    session_id: str
    idle_s: float
    blocks: int
    worker_id: int
    mode: str
    def __init__(self, seq_id: _Optional[int] = ..., session_id: _Optional[str] = ..., idle_s: _Optional[float] = ..., blocks: _Optional[int] = ..., worker_id: _Optional[int] = ..., mode: _Optional[str] = ...) -> None: ...

class EvictReply(_message.Message):
    __slots__ = ("seq_ids", "blocks_freed", "swapped", "dropped", "revoked", "free_blocks")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREED_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    blocks_freed: int
    swapped: _containers.RepeatedScalarFieldContainer[int]
    dropped: _containers.RepeatedScalarFieldContainer[int]
    revoked: _containers.RepeatedScalarFieldContainer[int]
    free_blocks: int
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., blocks_freed: _Optional[int] = ..., swapped: _Optional[_Iterable[int]] = ..., dropped: _Optional[_Iterable[int]] = ..., revoked: _Optional[_Iterable[int]] = ..., free_blocks: _Optional[int] = ...) -> None: ...

class CheckRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckReply(_message.Message):
    __slots__ = ("ok", "violations")
    OK_FIELD_NUMBER: _ClassVar[int]
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    violations: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ok: _Optional[bool] = ..., violations: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id", "undo", "wait_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    UNDO_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    undo: bool
    wait_s: float
    def __init__(self, worker_id: _Optional[int] = ..., undo: _Optional[bool] = ..., wait_s: _Optional[float] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("worker_ids", "running")
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    worker_ids: _containers.RepeatedScalarFieldContainer[int]
    running: int
    def __init__(self, worker_ids: _Optional[_Iterable[int]] = ..., running: _Optional[int] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("worker_id", "lease")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    lease: bytes
    def __init__(self, worker_id: _Optional[int] = ..., lease: _Optional[bytes] = ...) -> None: ...

class ResetPrefixCacheReply(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...

class ScrubRequest(_message.Message):
    __slots__ = ("rate_bytes_s",)
    RATE_BYTES_S_FIELD_NUMBER: _ClassVar[int]
    rate_bytes_s: float
    def __init__(self, rate_bytes_s: _Optional[float] = ...) -> None: ...

class ScrubFailure(_message.Message):
    __slots__ = ("where", "index", "seq_ids", "sessions")
    WHERE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    where: str
    index: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    sessions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, where: _Optional[str] = ..., index: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., sessions: _Optional[_Iterable[str]] = ...) -> None: ...

class ScrubReply(_message.Message):
    __slots__ = ("pages", "slots", "bytes", "seconds", "failures")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    pages: int
    slots: int
    bytes: int
    seconds: float
    failures: _containers.RepeatedCompositeFieldContainer[ScrubFailure]
    def __init__(self, pages: _Optional[int] = ..., slots: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., failures: _Optional[_Iterable[_Union[ScrubFailure, _Mapping]]] = ...) -> None: ...

class QuotasRequest(_message.Message):
    __slots__ = ("with_no_tenant",)
    WITH_NO_TENANT_FIELD_NUMBER: _ClassVar[int]
    with_no_tenant: bool
    def __init__(self, with_no_tenant: _Optional[bool] = ...) -> None: ...

class HolderRow(_message.Message):
    __slots__ = ("kind", "name", "guaranteed_pages", "max_pages", "pages", "evictions", "refusals", "set_at_run_time", "sequences", "retained_pages", "sessions", "swap_slots")
    class SequencesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    SET_AT_RUN_TIME_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RETAINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SLOTS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    guaranteed_pages: int
    max_pages: int
    pages: int
    evictions: int
    refusals: int
    set_at_run_time: bool
    sequences: _containers.ScalarMap[str, int]
    retained_pages: int
    sessions: int
    swap_slots: int
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., guaranteed_pages: _Optional[int] = ..., max_pages: _Optional[int] = ..., pages: _Optional[int] = ..., evictions: _Optional[int] = ..., refusals: _Optional[int] = ..., set_at_run_time: _Optional[bool] = ..., sequences: _Optional[_Mapping[str, int]] = ..., retained_pages: _Optional[int] = ..., sessions: _Optional[int] = ..., swap_slots: _Optional[int] = ...) -> None: ...

class QuotasReply(_message.Message):
    __slots__ = ("holders",)
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    holders: _containers.RepeatedCompositeFieldContainer[HolderRow]
    def __init__(self, holders: _Optional[_Iterable[_Union[HolderRow, _Mapping]]] = ...) -> None: ...

class SetQuotaRequest(_message.Message):
    __slots__ = ("kind", "name", "guaranteed_pages", "max_pages", "clear")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_PAGES_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    guaranteed_pages: int
    max_pages: int
    clear: bool
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., guaranteed_pages: _Optional[int] = ..., max_pages: _Optional[int] = ..., clear: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("worker_id", "lease", "queries")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    lease: bytes
    queries: _containers.RepeatedCompositeFieldContainer[LookupQuery]
    def __init__(self, worker_id: _Optional[int] = ..., lease: _Optional[bytes] = ..., queries: _Optional[_Iterable[_Union[LookupQuery, _Mapping]]] = ...) -> None: ...

class LookupQuery(_message.Message):
    __slots__ = ("token_ids", "cache_salt")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    cache_salt: str
    def __init__(self, token_ids: _Optional[bytes] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("cached_blocks",)
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    cached_blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cached_blocks: _Optional[_Iterable[int]] = ...) -> None: ...
