from chatmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolChoiceMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_MODE_UNSPECIFIED: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_AUTO: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_NONE: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_REQUIRED: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_NAMED: _ClassVar[ToolChoiceMode]

class TurnStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TURN_STATUS_UNSPECIFIED: _ClassVar[TurnStatus]
    TURN_STATUS_RUNNING: _ClassVar[TurnStatus]
    TURN_STATUS_COMPLETED: _ClassVar[TurnStatus]
    TURN_STATUS_STOPPED: _ClassVar[TurnStatus]
    TURN_STATUS_BLOCKED: _ClassVar[TurnStatus]
    TURN_STATUS_FAILED: _ClassVar[TurnStatus]
TOOL_CHOICE_MODE_UNSPECIFIED: ToolChoiceMode
TOOL_CHOICE_MODE_AUTO: ToolChoiceMode
TOOL_CHOICE_MODE_NONE: ToolChoiceMode
TOOL_CHOICE_MODE_REQUIRED: ToolChoiceMode
TOOL_CHOICE_MODE_NAMED: ToolChoiceMode
TURN_STATUS_UNSPECIFIED: TurnStatus
TURN_STATUS_RUNNING: TurnStatus
TURN_STATUS_COMPLETED: TurnStatus
TURN_STATUS_STOPPED: TurnStatus
TURN_STATUS_BLOCKED: TurnStatus
TURN_STATUS_FAILED: TurnStatus

class CreateConversationRequest(_message.Message):
    __slots__ = ("owner_id", "title", "messages")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    title: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.SeedMessage]
    def __init__(self, owner_id: _Optional[str] = ..., title: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.SeedMessage, _Mapping]]] = ...) -> None: ...

class CreateConversationResponse(_message.Message):
    __slots__ = ("conversation",)
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    conversation: _common_pb2.Conversation
    def __init__(self, conversation: _Optional[_Union[_common_pb2.Conversation, _Mapping]] = ...) -> None: ...

class GetConversationRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ...) -> None: ...

class GetConversationResponse(_message.Message):
    __slots__ = ("conversation", "messages")
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    conversation: _common_pb2.Conversation
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.Message]
    def __init__(self, conversation: _Optional[_Union[_common_pb2.Conversation, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.Message, _Mapping]]] = ...) -> None: ...

class SendTurnRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id", "content", "prompt_token_allowance", "options", "create", "expect_last_turn_id", "tool_results")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_ALLOWANCE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    EXPECT_LAST_TURN_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULTS_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    content: str
    prompt_token_allowance: int
    options: TurnOptions
    create: NewConversation
    expect_last_turn_id: str
    tool_results: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolResult]
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ..., content: _Optional[str] = ..., prompt_token_allowance: _Optional[int] = ..., options: _Optional[_Union[TurnOptions, _Mapping]] = ..., create: _Optional[_Union[NewConversation, _Mapping]] = ..., expect_last_turn_id: _Optional[str] = ..., tool_results: _Optional[_Iterable[_Union[_common_pb2.ToolResult, _Mapping]]] = ...) -> None: ...

class TurnOptions(_message.Message):
    __slots__ = ("temperature", "top_p", "seed", "stop", "max_tokens", "instructions", "tools", "tool_choice", "parallel_tool_calls", "compact_threshold_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    COMPACT_THRESHOLD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    max_tokens: int
    instructions: str
    tools: _containers.RepeatedCompositeFieldContainer[ToolDefinition]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    compact_threshold_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., max_tokens: _Optional[int] = ..., instructions: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[ToolDefinition, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., compact_threshold_tokens: _Optional[int] = ...) -> None: ...

class ToolDefinition(_message.Message):
    __slots__ = ("name", "definition_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEFINITION_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    definition_json: str
    def __init__(self, name: _Optional[str] = ..., definition_json: _Optional[str] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "name")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    mode: ToolChoiceMode
    name: str
    def __init__(self, mode: _Optional[_Union[ToolChoiceMode, str]] = ..., name: _Optional[str] = ...) -> None: ...

class NewConversation(_message.Message):
    __slots__ = ("title", "messages")
    TITLE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    title: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.SeedMessage]
    def __init__(self, title: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.SeedMessage, _Mapping]]] = ...) -> None: ...

class SendTurnResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: TurnEvent
    def __init__(self, event: _Optional[_Union[TurnEvent, _Mapping]] = ...) -> None: ...

class AttachTurnRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id", "after_sequence")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    after_sequence: int
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ..., after_sequence: _Optional[int] = ...) -> None: ...

class AttachTurnResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: TurnEvent
    def __init__(self, event: _Optional[_Union[TurnEvent, _Mapping]] = ...) -> None: ...

class StopTurnRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id", "release")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    release: bool
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ..., release: _Optional[bool] = ...) -> None: ...

class StopTurnResponse(_message.Message):
    __slots__ = ("stopped",)
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    stopped: bool
    def __init__(self, stopped: _Optional[bool] = ...) -> None: ...

class RegenerateTurnRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id", "prompt_token_allowance", "options")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_ALLOWANCE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    prompt_token_allowance: int
    options: TurnOptions
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ..., prompt_token_allowance: _Optional[int] = ..., options: _Optional[_Union[TurnOptions, _Mapping]] = ...) -> None: ...

class RegenerateTurnResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: TurnEvent
    def __init__(self, event: _Optional[_Union[TurnEvent, _Mapping]] = ...) -> None: ...

class ListConversationsRequest(_message.Message):
    __slots__ = ("owner_id", "page_size")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    page_size: int
    def __init__(self, owner_id: _Optional[str] = ..., page_size: _Optional[int] = ...) -> None: ...

class ListConversationsResponse(_message.Message):
    __slots__ = ("conversations",)
    CONVERSATIONS_FIELD_NUMBER: _ClassVar[int]
    conversations: _containers.RepeatedCompositeFieldContainer[_common_pb2.Conversation]
    def __init__(self, conversations: _Optional[_Iterable[_Union[_common_pb2.Conversation, _Mapping]]] = ...) -> None: ...

class DeleteConversationRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ...) -> None: ...

class DeleteConversationResponse(_message.Message):
    __slots__ = ("blocks_evicted",)
    BLOCKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    blocks_evicted: int
    def __init__(self, blocks_evicted: _Optional[int] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ("owner_id", "days")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    DAYS_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    days: int
    def __init__(self, owner_id: _Optional[str] = ..., days: _Optional[int] = ...) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("days",)
    DAYS_FIELD_NUMBER: _ClassVar[int]
    days: _containers.RepeatedCompositeFieldContainer[DailyUsage]
    def __init__(self, days: _Optional[_Iterable[_Union[DailyUsage, _Mapping]]] = ...) -> None: ...

class DailyUsage(_message.Message):
    __slots__ = ("day", "usage", "turns")
    DAY_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    day: str
    usage: _common_pb2.Usage
    turns: int
    def __init__(self, day: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., turns: _Optional[int] = ...) -> None: ...

class ExportUserDataRequest(_message.Message):
    __slots__ = ("owner_id",)
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    def __init__(self, owner_id: _Optional[str] = ...) -> None: ...

class ExportUserDataResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class TurnEvent(_message.Message):
    __slots__ = ("sequence", "started", "delta", "completed", "stopped", "failed", "blocked", "tool_call")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    started: TurnStarted
    delta: TurnDelta
    completed: TurnCompleted
    stopped: TurnStopped
    failed: TurnFailed
    blocked: TurnBlocked
    tool_call: TurnToolCall
    def __init__(self, sequence: _Optional[int] = ..., started: _Optional[_Union[TurnStarted, _Mapping]] = ..., delta: _Optional[_Union[TurnDelta, _Mapping]] = ..., completed: _Optional[_Union[TurnCompleted, _Mapping]] = ..., stopped: _Optional[_Union[TurnStopped, _Mapping]] = ..., failed: _Optional[_Union[TurnFailed, _Mapping]] = ..., blocked: _Optional[_Union[TurnBlocked, _Mapping]] = ..., tool_call: _Optional[_Union[TurnToolCall, _Mapping]] = ...) -> None: ...

class TurnToolCall(_message.Message):
    __slots__ = ("call", "index")
    CALL_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    call: _common_pb2.ToolCall
    index: int
    def __init__(self, call: _Optional[_Union[_common_pb2.ToolCall, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class TurnStarted(_message.Message):
    __slots__ = ("turn_id", "replayed", "prompt_tokens")
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    turn_id: str
    replayed: bool
    prompt_tokens: int
    def __init__(self, turn_id: _Optional[str] = ..., replayed: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class TurnDelta(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class TurnCompleted(_message.Message):
    __slots__ = ("usage", "replica_id", "finish_reason")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    usage: _common_pb2.Usage
    replica_id: str
    finish_reason: str
    def __init__(self, usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., replica_id: _Optional[str] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class TurnStopped(_message.Message):
    __slots__ = ("usage",)
    USAGE_FIELD_NUMBER: _ClassVar[int]
    usage: _common_pb2.Usage
    def __init__(self, usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class TurnFailed(_message.Message):
    __slots__ = ("message", "retryable")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    message: str
    retryable: bool
    def __init__(self, message: _Optional[str] = ..., retryable: _Optional[bool] = ...) -> None: ...

class TurnBlocked(_message.Message):
    __slots__ = ("stage", "category", "reason")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stage: str
    category: str
    reason: str
    def __init__(self, stage: _Optional[str] = ..., category: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class GetTurnRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ...) -> None: ...

class GetTurnResponse(_message.Message):
    __slots__ = ("status", "reply", "usage", "stored_at_ms", "finish_reason", "tool_calls")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STORED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    status: TurnStatus
    reply: str
    usage: _common_pb2.Usage
    stored_at_ms: int
    finish_reason: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    def __init__(self, status: _Optional[_Union[TurnStatus, str]] = ..., reply: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., stored_at_ms: _Optional[int] = ..., finish_reason: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ...) -> None: ...

class DeleteTurnRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ...) -> None: ...

class DeleteTurnResponse(_message.Message):
    __slots__ = ("blocks_evicted",)
    BLOCKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    blocks_evicted: int
    def __init__(self, blocks_evicted: _Optional[int] = ...) -> None: ...

class CompactConversationRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "expect_last_turn_id")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECT_LAST_TURN_ID_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    expect_last_turn_id: str
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., expect_last_turn_id: _Optional[str] = ...) -> None: ...

class CompactConversationResponse(_message.Message):
    __slots__ = ("summary_text", "covers_through_index", "token_count", "prompt_tokens")
    SUMMARY_TEXT_FIELD_NUMBER: _ClassVar[int]
    COVERS_THROUGH_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    summary_text: str
    covers_through_index: int
    token_count: int
    prompt_tokens: int
    def __init__(self, summary_text: _Optional[str] = ..., covers_through_index: _Optional[int] = ..., token_count: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...
