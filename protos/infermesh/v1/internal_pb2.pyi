from protos.infermesh.v1 import common_pb2 as _common_pb2
from protos.infermesh.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSPORT_UNSPECIFIED: _ClassVar[KVTransport]
    KV_TRANSPORT_GRPC_STREAM: _ClassVar[KVTransport]
    KV_TRANSPORT_TORCH_P2P: _ClassVar[KVTransport]
    KV_TRANSPORT_SHARED_MEMORY: _ClassVar[KVTransport]
    KV_TRANSPORT_MOONCAKE: _ClassVar[KVTransport]

class KVStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_STATUS_UNSPECIFIED: _ClassVar[KVStatus]
    KV_STATUS_READY: _ClassVar[KVStatus]
    KV_STATUS_FAILED: _ClassVar[KVStatus]

class CPMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CP_METHOD_UNSPECIFIED: _ClassVar[CPMethod]
    CP_METHOD_PASS_KV: _ClassVar[CPMethod]
    CP_METHOD_PASS_Q: _ClassVar[CPMethod]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]

class ProcessState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROCESS_STATE_UNSPECIFIED: _ClassVar[ProcessState]
    PROCESS_STATE_RUNNING: _ClassVar[ProcessState]
    PROCESS_STATE_RESTARTING: _ClassVar[ProcessState]
    PROCESS_STATE_DOWN: _ClassVar[ProcessState]
KV_TRANSPORT_UNSPECIFIED: KVTransport
KV_TRANSPORT_GRPC_STREAM: KVTransport
KV_TRANSPORT_TORCH_P2P: KVTransport
KV_TRANSPORT_SHARED_MEMORY: KVTransport
KV_TRANSPORT_MOONCAKE: KVTransport
KV_STATUS_UNSPECIFIED: KVStatus
KV_STATUS_READY: KVStatus
KV_STATUS_FAILED: KVStatus
CP_METHOD_UNSPECIFIED: CPMethod
CP_METHOD_PASS_KV: CPMethod
CP_METHOD_PASS_Q: CPMethod
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
PROCESS_STATE_UNSPECIFIED: ProcessState
PROCESS_STATE_RUNNING: ProcessState
PROCESS_STATE_RESTARTING: ProcessState
PROCESS_STATE_DOWN: ProcessState

class HeadRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("decode_id", "transport", "addresses", "head_ranges", "block_size", "block_table", "first_token", "dtype")
    DECODE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    HEAD_RANGES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    decode_id: str
    transport: KVTransport
    addresses: _containers.RepeatedScalarFieldContainer[str]
    head_ranges: _containers.RepeatedCompositeFieldContainer[HeadRange]
    block_size: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    dtype: DType
    def __init__(self, decode_id: _Optional[str] = ..., transport: _Optional[_Union[KVTransport, str]] = ..., addresses: _Optional[_Iterable[str]] = ..., head_ranges: _Optional[_Iterable[_Union[HeadRange, _Mapping]]] = ..., block_size: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "transport")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    transport: KVTransport
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., transport: _Optional[_Union[KVTransport, str]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("target",)
    TARGET_FIELD_NUMBER: _ClassVar[int]
    target: KVTarget
    def __init__(self, target: _Optional[_Union[KVTarget, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prefill_locally", "prompt_token_ids", "sampling", "first_token_id", "kv_status", "first_logprobs", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_STATUS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_locally: bool
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    first_token_id: int
    kv_status: KVStatus
    first_logprobs: _common_pb2.TokenLogprobs
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prefill_locally: _Optional[bool] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., first_token_id: _Optional[int] = ..., kv_status: _Optional[_Union[KVStatus, str]] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("decode", "cancel", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DECODE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    decode: DecodeRequest
    cancel: CancelRequest
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[_Union[CancelRequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StreamEvent(_message.Message):
    __slots__ = ("request_id", "response", "status_code", "status_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: _inference_pb2.GenerateResponse
    status_code: int
    status_message: str
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[_inference_pb2.GenerateResponse, _Mapping]] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[StreamEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[StreamEvent, _Mapping]]] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "target")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    target: KVTarget
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprobs", "cp_method", "cp_reason", "cached_tokens", "kv_status", "kv_bytes", "kv_seconds", "prefill_seconds")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CP_METHOD_FIELD_NUMBER: _ClassVar[int]
    CP_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_STATUS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprobs: _common_pb2.TokenLogprobs
    cp_method: CPMethod
    cp_reason: str
    cached_tokens: int
    kv_status: KVStatus
    kv_bytes: int
    kv_seconds: float
    prefill_seconds: float
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., cp_method: _Optional[_Union[CPMethod, str]] = ..., cp_reason: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., kv_status: _Optional[_Union[KVStatus, str]] = ..., kv_bytes: _Optional[int] = ..., kv_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ...) -> None: ...

class KVPiece(_message.Message):
    __slots__ = ("request_id", "layer", "dst_rank", "dst_slots", "run_tokens", "dtype", "keys", "values", "shm_path", "shm_offset", "shm_values_offset", "more_layers")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RUN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_VALUES_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MORE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layer: int
    dst_rank: int
    dst_slots: _containers.RepeatedScalarFieldContainer[int]
    run_tokens: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    keys: bytes
    values: bytes
    shm_path: str
    shm_offset: int
    shm_values_offset: int
    more_layers: _containers.RepeatedCompositeFieldContainer[KVLayerRef]
    def __init__(self, request_id: _Optional[str] = ..., layer: _Optional[int] = ..., dst_rank: _Optional[int] = ..., dst_slots: _Optional[_Iterable[int]] = ..., run_tokens: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., keys: _Optional[bytes] = ..., values: _Optional[bytes] = ..., shm_path: _Optional[str] = ..., shm_offset: _Optional[int] = ..., shm_values_offset: _Optional[int] = ..., more_layers: _Optional[_Iterable[_Union[KVLayerRef, _Mapping]]] = ...) -> None: ...

class KVLayerRef(_message.Message):
    __slots__ = ("layer", "keys_offset", "values_offset")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KEYS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    VALUES_OFFSET_FIELD_NUMBER: _ClassVar[int]
    layer: int
    keys_offset: int
    values_offset: int
    def __init__(self, layer: _Optional[int] = ..., keys_offset: _Optional[int] = ..., values_offset: _Optional[int] = ...) -> None: ...

class KVWriteRequest(_message.Message):
    __slots__ = ("open", "done")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    open: KVWriteOpen
    done: KVWriteDone
    def __init__(self, open: _Optional[_Union[KVWriteOpen, _Mapping]] = ..., done: _Optional[_Union[KVWriteDone, _Mapping]] = ...) -> None: ...

class KVWriteOpen(_message.Message):
    __slots__ = ("request_id", "dst_rank", "first_layer", "last_layer", "dst_slots", "run_tokens", "dtype")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_FIELD_NUMBER: _ClassVar[int]
    DST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RUN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    dst_rank: int
    first_layer: int
    last_layer: int
    dst_slots: _containers.RepeatedScalarFieldContainer[int]
    run_tokens: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, request_id: _Optional[str] = ..., dst_rank: _Optional[int] = ..., first_layer: _Optional[int] = ..., last_layer: _Optional[int] = ..., dst_slots: _Optional[_Iterable[int]] = ..., run_tokens: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class KVWriteDone(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class KVWriteResponse(_message.Message):
    __slots__ = ("grant", "ack")
    GRANT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    grant: KVWriteGrant
    ack: PushResponse
    def __init__(self, grant: _Optional[_Union[KVWriteGrant, _Mapping]] = ..., ack: _Optional[_Union[PushResponse, _Mapping]] = ...) -> None: ...

class KVWriteGrant(_message.Message):
    __slots__ = ("segment", "keys", "values")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    segment: str
    keys: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, segment: _Optional[str] = ..., keys: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[int]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("bytes", "pieces")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    pieces: int
    def __init__(self, bytes: _Optional[int] = ..., pieces: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class InstanceStatus(_message.Message):
    __slots__ = ("id", "role", "address", "pid", "model", "parallel", "state", "active_requests", "total_requests", "kv_blocks_used", "kv_blocks_total", "rendezvous", "placement", "expert_load", "attached", "block_size", "http_address", "metrics_url")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LOAD_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    id: str
    role: _common_pb2.Role
    address: str
    pid: int
    model: str
    parallel: _common_pb2.ParallelLayout
    state: _common_pb2.InstanceState
    active_requests: int
    total_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    rendezvous: str
    placement: _containers.RepeatedScalarFieldContainer[int]
    expert_load: _containers.RepeatedCompositeFieldContainer[ExpertLoad]
    attached: _containers.RepeatedScalarFieldContainer[str]
    block_size: int
    http_address: str
    metrics_url: str
    def __init__(self, id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., address: _Optional[str] = ..., pid: _Optional[int] = ..., model: _Optional[str] = ..., parallel: _Optional[_Union[_common_pb2.ParallelLayout, _Mapping]] = ..., state: _Optional[_Union[_common_pb2.InstanceState, str]] = ..., active_requests: _Optional[int] = ..., total_requests: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., rendezvous: _Optional[str] = ..., placement: _Optional[_Iterable[int]] = ..., expert_load: _Optional[_Iterable[_Union[ExpertLoad, _Mapping]]] = ..., attached: _Optional[_Iterable[str]] = ..., block_size: _Optional[int] = ..., http_address: _Optional[str] = ..., metrics_url: _Optional[str] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("layer", "tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("instance_id", "ranks", "model")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    ranks: int
    model: str
    def __init__(self, instance_id: _Optional[str] = ..., ranks: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("rendezvous", "group", "expert_ranks", "placement")
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EXPERT_RANKS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    rendezvous: str
    group: str
    expert_ranks: int
    placement: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rendezvous: _Optional[str] = ..., group: _Optional[str] = ..., expert_ranks: _Optional[int] = ..., placement: _Optional[_Iterable[int]] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("role", "instances")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    instances: int
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ..., instances: _Optional[int] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("started", "drained", "instances")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    started: _containers.RepeatedScalarFieldContainer[str]
    drained: _containers.RepeatedScalarFieldContainer[str]
    instances: int
    def __init__(self, started: _Optional[_Iterable[str]] = ..., drained: _Optional[_Iterable[str]] = ..., instances: _Optional[int] = ...) -> None: ...

class ProcessesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProcessStatus(_message.Message):
    __slots__ = ("name", "kind", "pid", "state", "restarts", "last_exit", "reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_EXIT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    pid: int
    state: ProcessState
    restarts: int
    last_exit: int
    reason: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., pid: _Optional[int] = ..., state: _Optional[_Union[ProcessState, str]] = ..., restarts: _Optional[int] = ..., last_exit: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ProcessesResponse(_message.Message):
    __slots__ = ("processes",)
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    processes: _containers.RepeatedCompositeFieldContainer[ProcessStatus]
    def __init__(self, processes: _Optional[_Iterable[_Union[ProcessStatus, _Mapping]]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("instance", "ttl_s")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceStatus
    ttl_s: float
    def __init__(self, instance: _Optional[_Union[InstanceStatus, _Mapping]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class RegistryAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceStatus]
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceStatus, _Mapping]]] = ...) -> None: ...

class SetBlockHashesRequest(_message.Message):
    __slots__ = ("id", "hashes", "ttl_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    id: str
    hashes: _containers.RepeatedScalarFieldContainer[int]
    ttl_s: float
    def __init__(self, id: _Optional[str] = ..., hashes: _Optional[_Iterable[int]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PrefixHitsRequest(_message.Message):
    __slots__ = ("chain",)
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    chain: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, chain: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefixHitsResponse(_message.Message):
    __slots__ = ("hits",)
    class HitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    HITS_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.ScalarMap[str, int]
    def __init__(self, hits: _Optional[_Mapping[str, int]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockHashes(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("instances", "blocks")
    class BlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: BlockHashes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[BlockHashes, _Mapping]] = ...) -> None: ...
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceStatus]
    blocks: _containers.MessageMap[str, BlockHashes]
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceStatus, _Mapping]]] = ..., blocks: _Optional[_Mapping[str, BlockHashes]] = ...) -> None: ...
