from chatmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PullOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PULL_OUTCOME_UNSPECIFIED: _ClassVar[PullOutcome]
    PULL_OUTCOME_PULLED: _ClassVar[PullOutcome]
    PULL_OUTCOME_NOT_NEEDED: _ClassVar[PullOutcome]
    PULL_OUTCOME_NOT_HELD: _ClassVar[PullOutcome]
    PULL_OUTCOME_UNAVAILABLE: _ClassVar[PullOutcome]
    PULL_OUTCOME_DEADLINE: _ClassVar[PullOutcome]
    PULL_OUTCOME_CORRUPT: _ClassVar[PullOutcome]
    PULL_OUTCOME_UNSUPPORTED: _ClassVar[PullOutcome]
    PULL_OUTCOME_NO_ROOM: _ClassVar[PullOutcome]
    PULL_OUTCOME_EVICTED: _ClassVar[PullOutcome]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
PULL_OUTCOME_UNSPECIFIED: PullOutcome
PULL_OUTCOME_PULLED: PullOutcome
PULL_OUTCOME_NOT_NEEDED: PullOutcome
PULL_OUTCOME_NOT_HELD: PullOutcome
PULL_OUTCOME_UNAVAILABLE: PullOutcome
PULL_OUTCOME_DEADLINE: PullOutcome
PULL_OUTCOME_CORRUPT: PullOutcome
PULL_OUTCOME_UNSUPPORTED: PullOutcome
PULL_OUTCOME_NO_ROOM: PullOutcome
PULL_OUTCOME_EVICTED: PullOutcome
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "conversation_id", "turn_id", "prompt_token_ids", "cache_salt", "platform_prefix_tokens", "max_tokens", "temperature", "top_p", "seed", "stop_token_ids", "owner_id", "expected_model", "source_replica_id", "source_address", "resumed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    conversation_id: str
    turn_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: bytes
    platform_prefix_tokens: int
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    owner_id: str
    expected_model: ModelIdentity
    source_replica_id: str
    source_address: str
    resumed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[bytes] = ..., platform_prefix_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., owner_id: _Optional[str] = ..., expected_model: _Optional[_Union[ModelIdentity, _Mapping]] = ..., source_replica_id: _Optional[str] = ..., source_address: _Optional[str] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class ModelIdentity(_message.Message):
    __slots__ = ("model_id", "tokenizer_digest")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tokenizer_digest: str
    def __init__(self, model_id: _Optional[str] = ..., tokenizer_digest: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("started", "delta", "finished")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    started: GenerateStarted
    delta: GenerateDelta
    finished: GenerateFinished
    def __init__(self, started: _Optional[_Union[GenerateStarted, _Mapping]] = ..., delta: _Optional[_Union[GenerateDelta, _Mapping]] = ..., finished: _Optional[_Union[GenerateFinished, _Mapping]] = ...) -> None: ...

class GenerateStarted(_message.Message):
    __slots__ = ("replica_id", "cached_prompt_tokens", "host_cached_prompt_tokens", "pulled_prompt_tokens", "pull_outcome")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULL_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    cached_prompt_tokens: int
    host_cached_prompt_tokens: int
    pulled_prompt_tokens: int
    pull_outcome: PullOutcome
    def __init__(self, replica_id: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ..., host_cached_prompt_tokens: _Optional[int] = ..., pulled_prompt_tokens: _Optional[int] = ..., pull_outcome: _Optional[_Union[PullOutcome, str]] = ...) -> None: ...

class GenerateDelta(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class GenerateFinished(_message.Message):
    __slots__ = ("finish_reason", "usage", "error_message")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: _common_pb2.Usage
    error_message: str
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error_message: _Optional[str] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("conversation_id", "cache_salt", "owner_id")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    cache_salt: bytes
    owner_id: str
    def __init__(self, conversation_id: _Optional[str] = ..., cache_salt: _Optional[bytes] = ..., owner_id: _Optional[str] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("blocks_evicted",)
    BLOCKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    blocks_evicted: int
    def __init__(self, blocks_evicted: _Optional[int] = ...) -> None: ...

class CancelTurnRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ...) -> None: ...

class CancelTurnResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: int
    def __init__(self, cancelled: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: EngineStats
    def __init__(self, stats: _Optional[_Union[EngineStats, _Mapping]] = ...) -> None: ...

class WatchStatsRequest(_message.Message):
    __slots__ = ("interval_ms", "include_residency")
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    include_residency: bool
    def __init__(self, interval_ms: _Optional[int] = ..., include_residency: _Optional[bool] = ...) -> None: ...

class WatchStatsResponse(_message.Message):
    __slots__ = ("stats", "residency")
    STATS_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    stats: EngineStats
    residency: ResidencyUpdate
    def __init__(self, stats: _Optional[_Union[EngineStats, _Mapping]] = ..., residency: _Optional[_Union[ResidencyUpdate, _Mapping]] = ...) -> None: ...

class ResidencyUpdate(_message.Message):
    __slots__ = ("full", "conversations")
    FULL_FIELD_NUMBER: _ClassVar[int]
    CONVERSATIONS_FIELD_NUMBER: _ClassVar[int]
    full: bool
    conversations: _containers.RepeatedCompositeFieldContainer[ConversationResidency]
    def __init__(self, full: _Optional[bool] = ..., conversations: _Optional[_Iterable[_Union[ConversationResidency, _Mapping]]] = ...) -> None: ...

class ConversationResidency(_message.Message):
    __slots__ = ("conversation_id", "cached_tokens")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    cached_tokens: int
    def __init__(self, conversation_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class KvTierStats(_message.Message):
    __slots__ = ("blocks_total", "blocks_used", "blocks_free", "blocks_cached")
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    blocks_total: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    def __init__(self, blocks_total: _Optional[int] = ..., blocks_used: _Optional[int] = ..., blocks_free: _Optional[int] = ..., blocks_cached: _Optional[int] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("replica_id", "backend", "queue_depth", "running_sequences", "block_size", "device", "host", "hit_tokens", "miss_tokens", "host_hit_tokens", "device_evictions", "host_evictions", "preemptions", "generations", "model", "prefix_transfer", "draining")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    backend: str
    queue_depth: int
    running_sequences: int
    block_size: int
    device: KvTierStats
    host: KvTierStats
    hit_tokens: int
    miss_tokens: int
    host_hit_tokens: int
    device_evictions: int
    host_evictions: int
    preemptions: int
    generations: int
    model: ModelIdentity
    prefix_transfer: PrefixTransferStats
    draining: bool
    def __init__(self, replica_id: _Optional[str] = ..., backend: _Optional[str] = ..., queue_depth: _Optional[int] = ..., running_sequences: _Optional[int] = ..., block_size: _Optional[int] = ..., device: _Optional[_Union[KvTierStats, _Mapping]] = ..., host: _Optional[_Union[KvTierStats, _Mapping]] = ..., hit_tokens: _Optional[int] = ..., miss_tokens: _Optional[int] = ..., host_hit_tokens: _Optional[int] = ..., device_evictions: _Optional[int] = ..., host_evictions: _Optional[int] = ..., preemptions: _Optional[int] = ..., generations: _Optional[int] = ..., model: _Optional[_Union[ModelIdentity, _Mapping]] = ..., prefix_transfer: _Optional[_Union[PrefixTransferStats, _Mapping]] = ..., draining: _Optional[bool] = ...) -> None: ...

class PrefixTransferStats(_message.Message):
    __slots__ = ("serves", "receives", "layout", "kv_bytes_per_token", "pulled_tokens", "pulled_bytes", "pulls", "failed_pulls", "served_blocks", "served_bytes")
    SERVES_FIELD_NUMBER: _ClassVar[int]
    RECEIVES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    FAILED_PULLS_FIELD_NUMBER: _ClassVar[int]
    SERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    serves: bool
    receives: bool
    layout: KvLayout
    kv_bytes_per_token: int
    pulled_tokens: int
    pulled_bytes: int
    pulls: int
    failed_pulls: int
    served_blocks: int
    served_bytes: int
    def __init__(self, serves: _Optional[bool] = ..., receives: _Optional[bool] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., kv_bytes_per_token: _Optional[int] = ..., pulled_tokens: _Optional[int] = ..., pulled_bytes: _Optional[int] = ..., pulls: _Optional[int] = ..., failed_pulls: _Optional[int] = ..., served_blocks: _Optional[int] = ..., served_bytes: _Optional[int] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("backend", "model", "block_size", "dtype", "block_bytes")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    model: ModelIdentity
    block_size: int
    dtype: str
    block_bytes: int
    def __init__(self, backend: _Optional[str] = ..., model: _Optional[_Union[ModelIdentity, _Mapping]] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class PullPrefixRequest(_message.Message):
    __slots__ = ("request_id", "owner_id", "conversation_id", "block_hashes", "layout", "max_message_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    owner_id: str
    conversation_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    layout: KvLayout
    max_message_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class PullPrefixResponse(_message.Message):
    __slots__ = ("started", "chunk")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    started: PullPrefixStarted
    chunk: KvBlockChunk
    def __init__(self, started: _Optional[_Union[PullPrefixStarted, _Mapping]] = ..., chunk: _Optional[_Union[KvBlockChunk, _Mapping]] = ...) -> None: ...

class PullPrefixStarted(_message.Message):
    __slots__ = ("blocks", "block_bytes")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    block_bytes: int
    def __init__(self, blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class KvBlockChunk(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[KvBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[KvBlock, _Mapping]]] = ...) -> None: ...

class KvBlock(_message.Message):
    __slots__ = ("block_hash", "payload", "digest")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    payload: bytes
    digest: bytes
    def __init__(self, block_hash: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., digest: _Optional[bytes] = ...) -> None: ...
