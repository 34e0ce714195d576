from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVBlockEvent(_message.Message):
    __slots__ = ("seq", "removed", "block_hashes")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    removed: bool
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, seq: _Optional[int] = ..., removed: _Optional[bool] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVCacheSnapshot(_message.Message):
    __slots__ = ("seq", "block_hashes")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("worker_id", "cluster_token", "epoch", "snapshot", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    cluster_token: str
    epoch: int
    snapshot: KVCacheSnapshot
    events: _containers.RepeatedCompositeFieldContainer[KVBlockEvent]
    def __init__(self, worker_id: _Optional[str] = ..., cluster_token: _Optional[str] = ..., epoch: _Optional[int] = ..., snapshot: _Optional[_Union[KVCacheSnapshot, _Mapping]] = ..., events: _Optional[_Iterable[_Union[KVBlockEvent, _Mapping]]] = ...) -> None: ...

class KVEventAck(_message.Message):
    __slots__ = ("known", "resync")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    known: bool
    resync: bool
    def __init__(self, known: _Optional[bool] = ..., resync: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "role", "address", "kv_address", "model", "kv_fingerprint", "max_model_len", "load", "cluster_token", "tp_size", "dp_size", "lease_s", "block_size", "prefix_caching", "accepts_cache_salt", "version", "outputs_address", "outputs_unix")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_UNIX_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.Role
    address: str
    kv_address: str
    model: str
    kv_fingerprint: str
    max_model_len: int
    load: _common_pb2.WorkerLoad
    cluster_token: str
    tp_size: int
    dp_size: int
    lease_s: float
    block_size: int
    prefix_caching: bool
    accepts_cache_salt: bool
    version: str
    outputs_address: str
    outputs_unix: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., address: _Optional[str] = ..., kv_address: _Optional[str] = ..., model: _Optional[str] = ..., kv_fingerprint: _Optional[str] = ..., max_model_len: _Optional[int] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., cluster_token: _Optional[str] = ..., tp_size: _Optional[int] = ..., dp_size: _Optional[int] = ..., lease_s: _Optional[float] = ..., block_size: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., accepts_cache_salt: _Optional[bool] = ..., version: _Optional[str] = ..., outputs_address: _Optional[str] = ..., outputs_unix: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s",)
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "load", "cluster_token")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: _common_pb2.WorkerLoad
    cluster_token: str
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., cluster_token: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "change_role")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    CHANGE_ROLE_FIELD_NUMBER: _ClassVar[int]
    known: bool
    change_role: _common_pb2.Role
    def __init__(self, known: _Optional[bool] = ..., change_role: _Optional[_Union[_common_pb2.Role, str]] = ...) -> None: ...

class OutputsRequest(_message.Message):
    __slots__ = ("subscriber_id", "cluster_token")
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    subscriber_id: str
    cluster_token: str
    def __init__(self, subscriber_id: _Optional[str] = ..., cluster_token: _Optional[str] = ...) -> None: ...

class OutputsFrame(_message.Message):
    __slots__ = ("batch", "end")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    batch: OutputBatch
    end: OutputsEnd
    def __init__(self, batch: _Optional[_Union[OutputBatch, _Mapping]] = ..., end: _Optional[_Union[OutputsEnd, _Mapping]] = ...) -> None: ...

class OutputsEnd(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class OutputBatch(_message.Message):
    __slots__ = ("tokens", "seq", "reserved", "token0s", "transfers")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    TOKEN0S_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Tokens]
    seq: int
    reserved: _containers.RepeatedCompositeFieldContainer[Reserved]
    token0s: _containers.RepeatedCompositeFieldContainer[Token0]
    transfers: _containers.RepeatedCompositeFieldContainer[TransferResult]
    def __init__(self, tokens: _Optional[_Iterable[_Union[Tokens, _Mapping]]] = ..., seq: _Optional[int] = ..., reserved: _Optional[_Iterable[_Union[Reserved, _Mapping]]] = ..., token0s: _Optional[_Iterable[_Union[Token0, _Mapping]]] = ..., transfers: _Optional[_Iterable[_Union[TransferResult, _Mapping]]] = ...) -> None: ...

class PrefillStarted(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillControlRequest(_message.Message):
    __slots__ = ("request_id", "destination", "queued")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    destination: KVDestination
    queued: ReservationQueued
    def __init__(self, request_id: _Optional[str] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., queued: _Optional[_Union[ReservationQueued, _Mapping]] = ...) -> None: ...

class PrefillControlResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class PrefillInput(_message.Message):
    __slots__ = ("request", "destination", "queued")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    request: PrefillRequest
    destination: KVDestination
    queued: ReservationQueued
    def __init__(self, request: _Optional[_Union[PrefillRequest, _Mapping]] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., queued: _Optional[_Union[ReservationQueued, _Mapping]] = ...) -> None: ...

class ReservationQueued(_message.Message):
    __slots__ = ("consumer_id",)
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    consumer_id: str
    def __init__(self, consumer_id: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "seed", "prior_output_ids", "cache_salt", "dp_rank", "subscriber_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    seed: int
    prior_output_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    dp_rank: int
    subscriber_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., prior_output_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., dp_rank: _Optional[int] = ..., subscriber_id: _Optional[str] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("consumer_id", "kv_address", "block_ids", "cached_blocks")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    consumer_id: str
    kv_address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_blocks: int
    def __init__(self, consumer_id: _Optional[str] = ..., kv_address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., cached_blocks: _Optional[int] = ...) -> None: ...

class PrefillOutput(_message.Message):
    __slots__ = ("token0", "transfer")
    TOKEN0_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    token0: Token0
    transfer: TransferResult
    def __init__(self, token0: _Optional[_Union[Token0, _Mapping]] = ..., transfer: _Optional[_Union[TransferResult, _Mapping]] = ...) -> None: ...

class Token0(_message.Message):
    __slots__ = ("token_id", "text", "logprob", "finish_reason", "stop_reason", "sampled_ns", "received_ns", "sent_ns", "cached_tokens", "request_id", "taken_ns", "emitted_ns")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_NS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    SENT_NS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TAKEN_NS_FIELD_NUMBER: _ClassVar[int]
    EMITTED_NS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: _common_pb2.TokenLogprob
    finish_reason: _common_pb2.FinishReason
    stop_reason: str
    sampled_ns: int
    received_ns: int
    sent_ns: int
    cached_tokens: int
    request_id: str
    taken_ns: int
    emitted_ns: int
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., sampled_ns: _Optional[int] = ..., received_ns: _Optional[int] = ..., sent_ns: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., taken_ns: _Optional[int] = ..., emitted_ns: _Optional[int] = ...) -> None: ...

class TransferResult(_message.Message):
    __slots__ = ("ok", "error", "kv_transfer_ms", "busy", "token0_routed", "request_id")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    TOKEN0_ROUTED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    kv_transfer_ms: float
    busy: bool
    token0_routed: bool
    request_id: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., kv_transfer_ms: _Optional[float] = ..., busy: _Optional[bool] = ..., token0_routed: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "seed", "colocated", "prior_output_ids", "source_tp_size", "subscriber_id", "cache_salt", "reuse_cached", "dp_rank")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    REUSE_CACHED_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    seed: int
    colocated: bool
    prior_output_ids: _containers.RepeatedScalarFieldContainer[int]
    source_tp_size: int
    subscriber_id: str
    cache_salt: str
    reuse_cached: bool
    dp_rank: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., colocated: _Optional[bool] = ..., prior_output_ids: _Optional[_Iterable[int]] = ..., source_tp_size: _Optional[int] = ..., subscriber_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., reuse_cached: _Optional[bool] = ..., dp_rank: _Optional[int] = ...) -> None: ...

class DecodeOutput(_message.Message):
    __slots__ = ("reserved", "tokens")
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    reserved: Reserved
    tokens: Tokens
    def __init__(self, reserved: _Optional[_Union[Reserved, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ...) -> None: ...

class DecodeStarted(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Reserved(_message.Message):
    __slots__ = ("kv_address", "block_ids", "cached_blocks", "request_id")
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    kv_address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_blocks: int
    request_id: str
    def __init__(self, kv_address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., cached_blocks: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "stop_reason", "error", "kv_ready_ns", "first_step_ns", "request_id", "cached_tokens", "notice_sent_ns", "notice_seen_ns", "kv_done_ns")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_READY_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_NS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NOTICE_SENT_NS_FIELD_NUMBER: _ClassVar[int]
    NOTICE_SEEN_NS_FIELD_NUMBER: _ClassVar[int]
    KV_DONE_NS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    stop_reason: str
    error: str
    kv_ready_ns: int
    first_step_ns: int
    request_id: str
    cached_tokens: int
    notice_sent_ns: int
    notice_seen_ns: int
    kv_done_ns: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., error: _Optional[str] = ..., kv_ready_ns: _Optional[int] = ..., first_step_ns: _Optional[int] = ..., request_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., notice_sent_ns: _Optional[int] = ..., notice_seen_ns: _Optional[int] = ..., kv_done_ns: _Optional[int] = ...) -> None: ...

class WorkerAbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class WorkerAbortResponse(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...
