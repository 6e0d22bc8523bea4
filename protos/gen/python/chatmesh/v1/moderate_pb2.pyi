from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModerationAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODERATION_ACTION_UNSPECIFIED: _ClassVar[ModerationAction]
    MODERATION_ACTION_ALLOW: _ClassVar[ModerationAction]
    MODERATION_ACTION_FLAG: _ClassVar[ModerationAction]
    MODERATION_ACTION_BLOCK: _ClassVar[ModerationAction]
MODERATION_ACTION_UNSPECIFIED: ModerationAction
MODERATION_ACTION_ALLOW: ModerationAction
MODERATION_ACTION_FLAG: ModerationAction
MODERATION_ACTION_BLOCK: ModerationAction

class CategoryScore(_message.Message):
    __slots__ = ("category", "score")
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    category: str
    score: float
    def __init__(self, category: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("action", "categories", "reason", "fallback")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    action: ModerationAction
    categories: _containers.RepeatedCompositeFieldContainer[CategoryScore]
    reason: str
    fallback: bool
    def __init__(self, action: _Optional[_Union[ModerationAction, str]] = ..., categories: _Optional[_Iterable[_Union[CategoryScore, _Mapping]]] = ..., reason: _Optional[str] = ..., fallback: _Optional[bool] = ...) -> None: ...

class CheckInputRequest(_message.Message):
    __slots__ = ("text", "conversation_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    conversation_id: str
    def __init__(self, text: _Optional[str] = ..., conversation_id: _Optional[str] = ...) -> None: ...

class CheckInputResponse(_message.Message):
    __slots__ = ("verdict",)
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    verdict: Verdict
    def __init__(self, verdict: _Optional[_Union[Verdict, _Mapping]] = ...) -> None: ...

class CheckOutputRequest(_message.Message):
    __slots__ = ("text", "conversation_id", "final")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    text: str
    conversation_id: str
    final: bool
    def __init__(self, text: _Optional[str] = ..., conversation_id: _Optional[str] = ..., final: _Optional[bool] = ...) -> None: ...

class CheckOutputResponse(_message.Message):
    __slots__ = ("chunk_index", "verdict", "checked_chars")
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    CHECKED_CHARS_FIELD_NUMBER: _ClassVar[int]
    chunk_index: int
    verdict: Verdict
    checked_chars: int
    def __init__(self, chunk_index: _Optional[int] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., checked_chars: _Optional[int] = ...) -> None: ...

class OutputChunk(_message.Message):
    __slots__ = ("reply_id", "text", "conversation_id", "final")
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    reply_id: str
    text: str
    conversation_id: str
    final: bool
    def __init__(self, reply_id: _Optional[str] = ..., text: _Optional[str] = ..., conversation_id: _Optional[str] = ..., final: _Optional[bool] = ...) -> None: ...

class CheckOutputBatchRequest(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[OutputChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[OutputChunk, _Mapping]]] = ...) -> None: ...

class OutputVerdict(_message.Message):
    __slots__ = ("reply_id", "chunk_index", "verdict", "checked_chars")
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    CHECKED_CHARS_FIELD_NUMBER: _ClassVar[int]
    reply_id: str
    chunk_index: int
    verdict: Verdict
    checked_chars: int
    def __init__(self, reply_id: _Optional[str] = ..., chunk_index: _Optional[int] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., checked_chars: _Optional[int] = ...) -> None: ...

class CheckOutputBatchResponse(_message.Message):
    __slots__ = ("verdicts",)
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    verdicts: _containers.RepeatedCompositeFieldContainer[OutputVerdict]
    def __init__(self, verdicts: _Optional[_Iterable[_Union[OutputVerdict, _Mapping]]] = ...) -> None: ...
