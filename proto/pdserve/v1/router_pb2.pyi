from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchRequest(_message.Message):
    __slots__ = ("cluster_token",)
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    cluster_token: str
    def __init__(self, cluster_token: _Optional[str] = ...) -> None: ...

class RegistryView(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerView]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerView, _Mapping]]] = ...) -> None: ...

class WorkerView(_message.Message):
    __slots__ = ("worker_id", "role", "address", "kv_address", "model", "kv_fingerprint", "max_model_len", "load", "version", "tp_size", "draining", "drain_reason", "target_role", "incarnation", "dp_size", "outputs_address", "outputs_unix")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DRAIN_REASON_FIELD_NUMBER: _ClassVar[int]
    TARGET_ROLE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
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
    version: str
    tp_size: int
    draining: bool
    drain_reason: str
    target_role: _common_pb2.Role
    incarnation: int
    dp_size: int
    outputs_address: str
    outputs_unix: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., address: _Optional[str] = ..., kv_address: _Optional[str] = ..., model: _Optional[str] = ..., kv_fingerprint: _Optional[str] = ..., max_model_len: _Optional[int] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., version: _Optional[str] = ..., tp_size: _Optional[int] = ..., draining: _Optional[bool] = ..., drain_reason: _Optional[str] = ..., target_role: _Optional[_Union[_common_pb2.Role, str]] = ..., incarnation: _Optional[int] = ..., dp_size: _Optional[int] = ..., outputs_address: _Optional[str] = ..., outputs_unix: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_call_id", "tool_calls_json", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_call_id: str
    tool_calls_json: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "tools_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "chat", "prompt_token_ids", "sampling", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    chat: ChatMessages
    prompt_token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "usage", "timing", "error", "stop_reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    usage: Usage
    timing: ServerTiming
    error: str
    stop_reason: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[ServerTiming, _Mapping]] = ..., error: _Optional[str] = ..., stop_reason: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ServerTiming(_message.Message):
    __slots__ = ("router_received_ns", "producer_received_ns", "producer_token0_sampled_ns", "router_token0_sent_ns", "consumer_kv_ready_ns", "consumer_first_step_ns", "router_finished_ns", "kv_transfer_ms", "producer", "consumer", "colocated", "producer_token0_sent_ns", "producer_token0_taken_ns", "router_token0_read_ns", "producer_notice_sent_ns", "consumer_notice_seen_ns", "consumer_kv_done_ns", "router_destination_sent_ns", "producer_token0_emitted_ns")
    ROUTER_RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_TOKEN0_SAMPLED_NS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_TOKEN0_SENT_NS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_KV_READY_NS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIRST_STEP_NS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FINISHED_NS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_TOKEN0_SENT_NS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_TOKEN0_TAKEN_NS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_TOKEN0_READ_NS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_NOTICE_SENT_NS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_NOTICE_SEEN_NS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_KV_DONE_NS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_DESTINATION_SENT_NS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_TOKEN0_EMITTED_NS_FIELD_NUMBER: _ClassVar[int]
    router_received_ns: int
    producer_received_ns: int
    producer_token0_sampled_ns: int
    router_token0_sent_ns: int
    consumer_kv_ready_ns: int
    consumer_first_step_ns: int
    router_finished_ns: int
    kv_transfer_ms: float
    producer: str
    consumer: str
    colocated: str
    producer_token0_sent_ns: int
    producer_token0_taken_ns: int
    router_token0_read_ns: int
    producer_notice_sent_ns: int
    consumer_notice_seen_ns: int
    consumer_kv_done_ns: int
    router_destination_sent_ns: int
    producer_token0_emitted_ns: int
    def __init__(self, router_received_ns: _Optional[int] = ..., producer_received_ns: _Optional[int] = ..., producer_token0_sampled_ns: _Optional[int] = ..., router_token0_sent_ns: _Optional[int] = ..., consumer_kv_ready_ns: _Optional[int] = ..., consumer_first_step_ns: _Optional[int] = ..., router_finished_ns: _Optional[int] = ..., kv_transfer_ms: _Optional[float] = ..., producer: _Optional[str] = ..., consumer: _Optional[str] = ..., colocated: _Optional[str] = ..., producer_token0_sent_ns: _Optional[int] = ..., producer_token0_taken_ns: _Optional[int] = ..., router_token0_read_ns: _Optional[int] = ..., producer_notice_sent_ns: _Optional[int] = ..., consumer_notice_seen_ns: _Optional[int] = ..., consumer_kv_done_ns: _Optional[int] = ..., router_destination_sent_ns: _Optional[int] = ..., producer_token0_emitted_ns: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "max_model_len")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ("include_requests",)
    INCLUDE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    include_requests: bool
    def __init__(self, include_requests: _Optional[bool] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("workers", "policy", "requests")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    policy: str
    requests: _containers.RepeatedCompositeFieldContainer[RequestStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., policy: _Optional[str] = ..., requests: _Optional[_Iterable[_Union[RequestStatus, _Mapping]]] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("request_id", "state", "age_s", "producer", "consumer", "colocated", "tokens_streamed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_STREAMED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: str
    age_s: float
    producer: str
    consumer: str
    colocated: str
    tokens_streamed: int
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[str] = ..., age_s: _Optional[float] = ..., producer: _Optional[str] = ..., consumer: _Optional[str] = ..., colocated: _Optional[str] = ..., tokens_streamed: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "address", "load", "last_heartbeat_age_s", "healthy", "unhealthy_reason", "kv_fingerprint", "version", "kv_address", "draining", "target_role", "tp_size", "outputs_address", "outputs_transport", "outputs_unix")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TARGET_ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_UNIX_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.Role
    address: str
    load: _common_pb2.WorkerLoad
    last_heartbeat_age_s: float
    healthy: bool
    unhealthy_reason: str
    kv_fingerprint: str
    version: str
    kv_address: str
    draining: bool
    target_role: _common_pb2.Role
    tp_size: int
    outputs_address: str
    outputs_transport: str
    outputs_unix: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., address: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., last_heartbeat_age_s: _Optional[float] = ..., healthy: _Optional[bool] = ..., unhealthy_reason: _Optional[str] = ..., kv_fingerprint: _Optional[str] = ..., version: _Optional[str] = ..., kv_address: _Optional[str] = ..., draining: _Optional[bool] = ..., target_role: _Optional[_Union[_common_pb2.Role, str]] = ..., tp_size: _Optional[int] = ..., outputs_address: _Optional[str] = ..., outputs_transport: _Optional[str] = ..., outputs_unix: _Optional[str] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id", "cluster_token", "done", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    cluster_token: str
    done: bool
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., cluster_token: _Optional[str] = ..., done: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class OrdersRequest(_message.Message):
    __slots__ = ("worker_id", "cluster_token")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    cluster_token: str
    def __init__(self, worker_id: _Optional[str] = ..., cluster_token: _Optional[str] = ...) -> None: ...

class OrdersResponse(_message.Message):
    __slots__ = ("change_role",)
    CHANGE_ROLE_FIELD_NUMBER: _ClassVar[int]
    change_role: _common_pb2.Role
    def __init__(self, change_role: _Optional[_Union[_common_pb2.Role, str]] = ...) -> None: ...

class ChangeSplitRequest(_message.Message):
    __slots__ = ("producers", "consumers", "colocated", "step_timeout_s")
    PRODUCERS_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    producers: int
    consumers: int
    colocated: int
    step_timeout_s: float
    def __init__(self, producers: _Optional[int] = ..., consumers: _Optional[int] = ..., colocated: _Optional[int] = ..., step_timeout_s: _Optional[float] = ...) -> None: ...

class ChangeSplitProgress(_message.Message):
    __slots__ = ("worker_id", "from_role", "to_role", "state", "message", "done", "error")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    TO_ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    from_role: _common_pb2.Role
    to_role: _common_pb2.Role
    state: str
    message: str
    done: bool
    error: str
    def __init__(self, worker_id: _Optional[str] = ..., from_role: _Optional[_Union[_common_pb2.Role, str]] = ..., to_role: _Optional[_Union[_common_pb2.Role, str]] = ..., state: _Optional[str] = ..., message: _Optional[str] = ..., done: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
