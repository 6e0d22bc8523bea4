from chatmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InsertConversationRequest(_message.Message):
    __slots__ = ("owner_id", "title", "system_prompt_version")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_VERSION_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    title: str
    system_prompt_version: str
    def __init__(self, owner_id: _Optional[str] = ..., title: _Optional[str] = ..., system_prompt_version: _Optional[str] = ...) -> None: ...

class InsertConversationResponse(_message.Message):
    __slots__ = ("conversation",)
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    conversation: _common_pb2.Conversation
    def __init__(self, conversation: _Optional[_Union[_common_pb2.Conversation, _Mapping]] = ...) -> None: ...

class ReadConversationRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ...) -> None: ...

class ReadConversationResponse(_message.Message):
    __slots__ = ("conversation", "messages")
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    conversation: _common_pb2.Conversation
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.Message]
    def __init__(self, conversation: _Optional[_Union[_common_pb2.Conversation, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.Message, _Mapping]]] = ...) -> None: ...

class BeginTurnRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id", "fingerprint", "content", "lease_holder", "lease_ttl_ms")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    LEASE_HOLDER_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    fingerprint: str
    content: str
    lease_holder: str
    lease_ttl_ms: int
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., content: _Optional[str] = ..., lease_holder: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("lease_id", "lease_expires_at_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_expires_at_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., lease_expires_at_ms: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("owner_id", "conversation_id", "turn_id", "lease_id", "user_token_count", "reply", "reply_token_count", "reply_status", "usage")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    USER_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    REPLY_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    REPLY_STATUS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    lease_id: str
    user_token_count: int
    reply: str
    reply_token_count: int
    reply_status: _common_pb2.MessageStatus
    usage: _common_pb2.Usage
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., user_token_count: _Optional[int] = ..., reply: _Optional[str] = ..., reply_token_count: _Optional[int] = ..., reply_status: _Optional[_Union[_common_pb2.MessageStatus, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class FinishTurnResponse(_message.Message):
    __slots__ = ("already_finished", "reply")
    ALREADY_FINISHED_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    already_finished: bool
    reply: _common_pb2.Message
    def __init__(self, already_finished: _Optional[bool] = ..., reply: _Optional[_Union[_common_pb2.Message, _Mapping]] = ...) -> None: ...

class FailTurnRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "turn_id", "lease_id", "reason")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    turn_id: str
    lease_id: str
    reason: str
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., turn_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class FailTurnResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
