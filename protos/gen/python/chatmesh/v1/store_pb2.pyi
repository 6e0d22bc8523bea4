from chatmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TurnState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TURN_STATE_UNSPECIFIED: _ClassVar[TurnState]
    TURN_STATE_RECEIVED: _ClassVar[TurnState]
    TURN_STATE_RUNNING: _ClassVar[TurnState]
    TURN_STATE_STORED: _ClassVar[TurnState]
    TURN_STATE_STOPPED: _ClassVar[TurnState]
    TURN_STATE_FAILED: _ClassVar[TurnState]
TURN_STATE_UNSPECIFIED: TurnState
TURN_STATE_RECEIVED: TurnState
TURN_STATE_RUNNING: TurnState
TURN_STATE_STORED: TurnState
TURN_STATE_STOPPED: TurnState
TURN_STATE_FAILED: TurnState

class ConversationSummary(_message.Message):
    __slots__ = ("text", "covers_through_index", "token_count", "created_at_ms")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    COVERS_THROUGH_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    text: str
    covers_through_index: int
    token_count: int
    created_at_ms: int
    def __init__(self, text: _Optional[str] = ..., covers_through_index: _Optional[int] = ..., token_count: _Optional[int] = ..., created_at_ms: _Optional[int] = ...) -> None: ...

class OwnedConversation(_message.Message):
    __slots__ = ("owner_id", "conversation_id")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ...) -> None: ...

class UsageDay(_message.Message):
    __slots__ = ("day", "usage", "turns")
    DAY_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    day: str
    usage: _common_pb2.Usage
    turns: int
    def __init__(self, day: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., turns: _Optional[int] = ...) -> None: ...

class UpdateTurnProgressRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id", "lease_id", "partial_text", "event_sequence", "lease_ttl_ms")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_TEXT_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    lease_id: str
    partial_text: str
    event_sequence: int
    lease_ttl_ms: int
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., partial_text: _Optional[str] = ..., event_sequence: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class UpdateTurnProgressResponse(_message.Message):
    __slots__ = ("held", "lease_expires_at_ms")
    HELD_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    held: bool
    lease_expires_at_ms: int
    def __init__(self, held: _Optional[bool] = ..., lease_expires_at_ms: _Optional[int] = ...) -> None: ...

class ReadTurnRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ...) -> None: ...

class ReadTurnResponse(_message.Message):
    __slots__ = ("state", "fingerprint", "lease_holder", "lease_expires_at_ms", "partial_text", "event_sequence", "regenerates_turn_id", "reply", "usage")
    STATE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_HOLDER_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_TEXT_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    REGENERATES_TURN_ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    state: TurnState
    fingerprint: str
    lease_holder: str
    lease_expires_at_ms: int
    partial_text: str
    event_sequence: int
    regenerates_turn_id: str
    reply: _common_pb2.Message
    usage: _common_pb2.Usage
    def __init__(self, state: _Optional[_Union[TurnState, str]] = ..., fingerprint: _Optional[str] = ..., lease_holder: _Optional[str] = ..., lease_expires_at_ms: _Optional[int] = ..., partial_text: _Optional[str] = ..., event_sequence: _Optional[int] = ..., regenerates_turn_id: _Optional[str] = ..., reply: _Optional[_Union[_common_pb2.Message, _Mapping]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class SaveSummaryRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "text", "covers_through_index", "token_count")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    COVERS_THROUGH_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    text: str
    covers_through_index: int
    token_count: int
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., text: _Optional[str] = ..., covers_through_index: _Optional[int] = ..., token_count: _Optional[int] = ...) -> None: ...

class SaveSummaryResponse(_message.Message):
    __slots__ = ("summary",)
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    summary: ConversationSummary
    def __init__(self, summary: _Optional[_Union[ConversationSummary, _Mapping]] = ...) -> None: ...

class ListOwnerConversationsRequest(_message.Message):
    __slots__ = ("owner_id", "page_size")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    page_size: int
    def __init__(self, owner_id: _Optional[str] = ..., page_size: _Optional[int] = ...) -> None: ...

class ListOwnerConversationsResponse(_message.Message):
    __slots__ = ("conversations",)
    CONVERSATIONS_FIELD_NUMBER: _ClassVar[int]
    conversations: _containers.RepeatedCompositeFieldContainer[_common_pb2.Conversation]
    def __init__(self, conversations: _Optional[_Iterable[_Union[_common_pb2.Conversation, _Mapping]]] = ...) -> None: ...

class DeleteStoredConversationRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ...) -> None: ...

class DeleteStoredConversationResponse(_message.Message):
    __slots__ = ("evict_conversation_ids",)
    EVICT_CONVERSATION_IDS_FIELD_NUMBER: _ClassVar[int]
    evict_conversation_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, evict_conversation_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteOwnerDataRequest(_message.Message):
    __slots__ = ("owner_id",)
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    def __init__(self, owner_id: _Optional[str] = ...) -> None: ...

class DeleteOwnerDataResponse(_message.Message):
    __slots__ = ("evict_conversation_ids",)
    EVICT_CONVERSATION_IDS_FIELD_NUMBER: _ClassVar[int]
    evict_conversation_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, evict_conversation_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ExportOwnerDataRequest(_message.Message):
    __slots__ = ("owner_id",)
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    def __init__(self, owner_id: _Optional[str] = ...) -> None: ...

class ExportOwnerDataResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class ReadUsageRequest(_message.Message):
    __slots__ = ("owner_id", "days")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    DAYS_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    days: int
    def __init__(self, owner_id: _Optional[str] = ..., days: _Optional[int] = ...) -> None: ...

class ReadUsageResponse(_message.Message):
    __slots__ = ("days",)
    DAYS_FIELD_NUMBER: _ClassVar[int]
    days: _containers.RepeatedCompositeFieldContainer[UsageDay]
    def __init__(self, days: _Optional[_Iterable[_Union[UsageDay, _Mapping]]] = ...) -> None: ...

class PurgeExpiredRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PurgeExpiredResponse(_message.Message):
    __slots__ = ("purged", "abandoned_turns")
    PURGED_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_TURNS_FIELD_NUMBER: _ClassVar[int]
    purged: _containers.RepeatedCompositeFieldContainer[OwnedConversation]
    abandoned_turns: int
    def __init__(self, purged: _Optional[_Iterable[_Union[OwnedConversation, _Mapping]]] = ..., abandoned_turns: _Optional[int] = ...) -> None: ...

class InsertConversationRequest(_message.Message):
    __slots__ = ("owner_id", "title", "system_prompt_version", "conversation_id", "messages")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    title: str
    system_prompt_version: str
    conversation_id: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.SeedMessage]
    def __init__(self, owner_id: _Optional[str] = ..., title: _Optional[str] = ..., system_prompt_version: _Optional[str] = ..., conversation_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.SeedMessage, _Mapping]]] = ...) -> None: ...

class InsertConversationResponse(_message.Message):
    __slots__ = ("conversation", "created")
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    conversation: _common_pb2.Conversation
    created: bool
    def __init__(self, conversation: _Optional[_Union[_common_pb2.Conversation, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class ReadConversationRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "from_index", "max_messages")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_INDEX_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    from_index: int
    max_messages: int
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., from_index: _Optional[int] = ..., max_messages: _Optional[int] = ...) -> None: ...

class ReadConversationResponse(_message.Message):
    __slots__ = ("conversation", "messages", "summary", "message_count")
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_COUNT_FIELD_NUMBER: _ClassVar[int]
    conversation: _common_pb2.Conversation
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.Message]
    summary: ConversationSummary
    message_count: int
    def __init__(self, conversation: _Optional[_Union[_common_pb2.Conversation, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.Message, _Mapping]]] = ..., summary: _Optional[_Union[ConversationSummary, _Mapping]] = ..., message_count: _Optional[int] = ...) -> None: ...

class BeginTurnRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id", "fingerprint", "content", "lease_holder", "lease_ttl_ms", "regenerates_turn_id", "context_max_messages", "generation_options", "tool_results")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    LEASE_HOLDER_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    REGENERATES_TURN_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_MAX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULTS_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    fingerprint: str
    content: str
    lease_holder: str
    lease_ttl_ms: int
    regenerates_turn_id: str
    context_max_messages: int
    generation_options: str
    tool_results: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolResult]
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., content: _Optional[str] = ..., lease_holder: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., regenerates_turn_id: _Optional[str] = ..., context_max_messages: _Optional[int] = ..., generation_options: _Optional[str] = ..., tool_results: _Optional[_Iterable[_Union[_common_pb2.ToolResult, _Mapping]]] = ...) -> None: ...

class BeginTurnResponse(_message.Message):
    __slots__ = ("claimed", "in_progress", "done", "conflict")
    CLAIMED_FIELD_NUMBER: _ClassVar[int]
    IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    CONFLICT_FIELD_NUMBER: _ClassVar[int]
    claimed: TurnClaimed
    in_progress: TurnInProgress
    done: TurnDone
    conflict: TurnConflict
    def __init__(self, claimed: _Optional[_Union[TurnClaimed, _Mapping]] = ..., in_progress: _Optional[_Union[TurnInProgress, _Mapping]] = ..., done: _Optional[_Union[TurnDone, _Mapping]] = ..., conflict: _Optional[_Union[TurnConflict, _Mapping]] = ...) -> None: ...

class TurnClaimed(_message.Message):
    __slots__ = ("lease_id", "lease_expires_at_ms", "context", "generation_options", "resume_text", "taken_over")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TEXT_FIELD_NUMBER: _ClassVar[int]
    TAKEN_OVER_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_expires_at_ms: int
    context: ReadConversationResponse
    generation_options: str
    resume_text: str
    taken_over: bool
    def __init__(self, lease_id: _Optional[str] = ..., lease_expires_at_ms: _Optional[int] = ..., context: _Optional[_Union[ReadConversationResponse, _Mapping]] = ..., generation_options: _Optional[str] = ..., resume_text: _Optional[str] = ..., taken_over: _Optional[bool] = ...) -> None: ...

class TurnInProgress(_message.Message):
    __slots__ = ("lease_holder", "lease_expires_at_ms")
    LEASE_HOLDER_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    lease_holder: str
    lease_expires_at_ms: int
    def __init__(self, lease_holder: _Optional[str] = ..., lease_expires_at_ms: _Optional[int] = ...) -> None: ...

class TurnDone(_message.Message):
    __slots__ = ("reply", "usage")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    reply: _common_pb2.Message
    usage: _common_pb2.Usage
    def __init__(self, reply: _Optional[_Union[_common_pb2.Message, _Mapping]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class TurnConflict(_message.Message):
    __slots__ = ("stored_fingerprint",)
    STORED_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    stored_fingerprint: str
    def __init__(self, stored_fingerprint: _Optional[str] = ...) -> None: ...

class FinishTurnRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id", "lease_id", "user_token_count", "reply", "reply_token_count", "reply_status", "usage", "user_status", "reply_tool_calls")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    USER_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    REPLY_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    REPLY_STATUS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    USER_STATUS_FIELD_NUMBER: _ClassVar[int]
    REPLY_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    lease_id: str
    user_token_count: int
    reply: str
    reply_token_count: int
    reply_status: _common_pb2.MessageStatus
    usage: _common_pb2.Usage
    user_status: _common_pb2.MessageStatus
    reply_tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., user_token_count: _Optional[int] = ..., reply: _Optional[str] = ..., reply_token_count: _Optional[int] = ..., reply_status: _Optional[_Union[_common_pb2.MessageStatus, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., user_status: _Optional[_Union[_common_pb2.MessageStatus, str]] = ..., reply_tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ...) -> None: ...

class FinishTurnResponse(_message.Message):
    __slots__ = ("already_finished", "reply")
    ALREADY_FINISHED_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    already_finished: bool
    reply: _common_pb2.Message
    def __init__(self, already_finished: _Optional[bool] = ..., reply: _Optional[_Union[_common_pb2.Message, _Mapping]] = ...) -> None: ...

class FailTurnRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id", "lease_id", "reason", "partial_text")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_TEXT_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    lease_id: str
    reason: str
    partial_text: str
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., reason: _Optional[str] = ..., partial_text: _Optional[str] = ...) -> None: ...

class FailTurnResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DeleteStoredTurnRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ...) -> None: ...

class DeleteStoredTurnResponse(_message.Message):
    __slots__ = ("evict_conversation_ids", "messages_deleted")
    EVICT_CONVERSATION_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_DELETED_FIELD_NUMBER: _ClassVar[int]
    evict_conversation_ids: _containers.RepeatedScalarFieldContainer[str]
    messages_deleted: int
    def __init__(self, evict_conversation_ids: _Optional[_Iterable[str]] = ..., messages_deleted: _Optional[int] = ...) -> None: ...
