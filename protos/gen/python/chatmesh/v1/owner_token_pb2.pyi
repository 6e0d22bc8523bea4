from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class IssueOwnerTokenRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "ttl_s")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    ttl_s: int
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class IssueOwnerTokenResponse(_message.Message):
    __slots__ = ("token", "expires_at_ms", "metadata_key", "key_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    METADATA_KEY_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    token: str
    expires_at_ms: int
    metadata_key: str
    key_id: str
    def __init__(self, token: _Optional[str] = ..., expires_at_ms: _Optional[int] = ..., metadata_key: _Optional[str] = ..., key_id: _Optional[str] = ...) -> None: ...
