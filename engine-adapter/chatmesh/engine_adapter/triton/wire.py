"""The tensors between the `triton` backend and chatmesh's Triton model (`chatmesh_llm`), both directions.

One Triton request is one generation, or one control command (stats, evict, residency). The model is decoupled: a
generation answers with a stream of responses, each naming its kind in the `event` output:

    started   cached_prompt_tokens, host_cached_prompt_tokens, stats_json
    delta     token_ids, text
    first     started and the first delta together (what the model sends when a token follows Started)
    finished  finish_reason, prompt_tokens, cached_prompt_tokens, output_tokens, error_message, stats_json
    error     error_kind, error_message   (the request was refused before it started: bad argument, queue full)
    stats     stats_json
    evicted   blocks_evicted
    residency text: JSON {"epoch", "version", "full", "conversations": [[id, cached tokens], ...]}, or
              {"epoch", "supported": false} when the model's engine cannot tell which conversations it holds

Inputs (every one optional in config.pbtxt; the model validates through `GenerateParams`):
    command                 BYTES [1]   generate (default), stats, evict_conversation, evict_salt, residency
                                        (residency: `seed` carries the client's cursor + 1, 0 for a full listing)
    prompt_token_ids        INT32 [-1]  the prompt, token ids of the served model's tokenizer
    max_tokens              INT32 [1]
    temperature, top_p      FP32 [1]    0 temperature is greedy; 0 top_p means 1
    seed                    UINT64 [1]
    cache_salt              BYTES [1]   the owner's salt (I1)
    platform_prefix_tokens  INT32 [1]   leading prompt tokens shared across owners
    stop_token_ids          INT32 [-1]  extra stop ids (end of turn always stops)
    conversation_id, turn_id, request_id  BYTES [1]

Everything here is numpy and chatmesh values: the model (inside Triton's stub) and the client share it, and the
round trip is tested without a server.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt

from chatmesh.engine_adapter.backend import (
    Delta,
    EngineStats,
    Finished,
    FinishReason,
    GenerateEvent,
    GenerateParams,
    Residency,
    Started,
    TierStats,
    Usage,
)
from chatmesh.engine_adapter.executor import SamplingParams
from chatmesh.engine_adapter.residency import FROM_START
from chatmesh.mesh.errors import CoreError, InvalidArgument, ResourceExhausted
from chatmesh.mesh.ids import ConversationId, parse_conversation_id, parse_turn_id
from chatmesh.model.profile import ModelIdentity

Array = npt.NDArray[np.generic]
Getter = Callable[[str], Array | None]

MODEL_NAME = "chatmesh_llm"


class Command(enum.Enum):
    GENERATE = "generate"
    STATS = "stats"
    EVICT_CONVERSATION = "evict_conversation"
    EVICT_SALT = "evict_salt"
    RESIDENCY = "residency"


class WireEvent(enum.Enum):
    STARTED = "started"
    DELTA = "delta"
    FIRST = "first"  # started + the first delta in one response: one IPC and one message fewer per generation
    FINISHED = "finished"
    ERROR = "error"
    STATS = "stats"
    EVICTED = "evicted"
    RESIDENCY = "residency"


class ErrorKind(enum.Enum):
    """A refusal the model reports as a typed error, so the client raises the matching core error."""

    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    INTERNAL = "internal"


# (name, Triton data type, dims) of every input and output: config.pbtxt is rendered from these.
INPUTS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("command", "TYPE_STRING", (1,)),
    ("prompt_token_ids", "TYPE_INT32", (-1,)),
    ("max_tokens", "TYPE_INT32", (1,)),
    ("temperature", "TYPE_FP32", (1,)),
    ("top_p", "TYPE_FP32", (1,)),
    ("seed", "TYPE_UINT64", (1,)),
    ("cache_salt", "TYPE_STRING", (1,)),
    ("platform_prefix_tokens", "TYPE_INT32", (1,)),
    ("stop_token_ids", "TYPE_INT32", (-1,)),
    ("conversation_id", "TYPE_STRING", (1,)),
    ("turn_id", "TYPE_STRING", (1,)),
    ("request_id", "TYPE_STRING", (1,)),
)
OUTPUTS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("event", "TYPE_STRING", (1,)),
    ("token_ids", "TYPE_INT32", (-1,)),
    ("text", "TYPE_STRING", (1,)),
    ("cached_prompt_tokens", "TYPE_INT32", (1,)),
    ("host_cached_prompt_tokens", "TYPE_INT32", (1,)),
    ("finish_reason", "TYPE_STRING", (1,)),
    ("prompt_tokens", "TYPE_INT32", (1,)),
    ("output_tokens", "TYPE_INT32", (1,)),
    ("error_kind", "TYPE_STRING", (1,)),
    ("error_message", "TYPE_STRING", (1,)),
    ("stats_json", "TYPE_STRING", (1,)),
    ("blocks_evicted", "TYPE_INT64", (1,)),
)
# Triton's data types as tritonclient spells them.
CLIENT_DTYPE = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_INT64": "INT64", "TYPE_FP32": "FP32",
                "TYPE_UINT64": "UINT64"}


def _bytes(value: bytes | str) -> Array:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)


def _i32(values: object) -> Array:
    return np.asarray(values, dtype=np.int32).reshape(-1)


def _scalar(get: Getter, name: str) -> object | None:
    arr = get(name)
    if arr is None or arr.size == 0:
        return None
    value: object = arr.reshape(-1)[0]
    return value


def text_of(get: Getter, name: str) -> str:
    value = _scalar(get, name)
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def bytes_of(get: Getter, name: str) -> bytes:
    value = _scalar(get, name)
    if value is None:
        return b""
    return value if isinstance(value, bytes) else str(value).encode()


def _int(get: Getter, name: str, default: int = 0) -> int:
    value = _scalar(get, name)
    return default if value is None else int(value)  # type: ignore[call-overload]


def _float(get: Getter, name: str, default: float = 0.0) -> float:
    value = _scalar(get, name)
    return default if value is None else float(value)  # type: ignore[arg-type]


# ---- requests -------------------------------------------------------------------------------------------------

def command_tensors(command: Command, argument: bytes | str | int = b"", salt: bytes = b"") -> dict[str, Array]:
    """A control command's inputs; an evict_conversation with `salt` drops only that owner's blocks."""
    out = {"command": _bytes(command.value)}
    match command:
        case Command.GENERATE | Command.STATS:
            pass
        case Command.EVICT_CONVERSATION:
            assert not isinstance(argument, int)
            out["conversation_id"] = _bytes(argument)
            if salt:
                out["cache_salt"] = _bytes(salt)
        case Command.EVICT_SALT:
            assert not isinstance(argument, int)
            out["cache_salt"] = _bytes(argument)
        case Command.RESIDENCY:
            assert isinstance(argument, int) and argument >= FROM_START
            out["seed"] = np.array([argument + 1], dtype=np.uint64)
        case _:
            raise AssertionError(command)
    return out


def cursor_of(get: Getter) -> int:
    """The residency cursor a `residency` command carries."""
    return _int(get, "seed") - 1


def request_tensors(params: GenerateParams) -> dict[str, Array]:
    """The inputs of one generation."""
    s = params.sampling
    return {
        "command": _bytes(Command.GENERATE.value),
        "prompt_token_ids": _i32(params.prompt_token_ids),
        "max_tokens": _i32([params.max_tokens]),
        "temperature": np.array([s.temperature], dtype=np.float32),
        "top_p": np.array([s.top_p], dtype=np.float32),
        "seed": np.array([s.seed], dtype=np.uint64),
        "cache_salt": _bytes(params.cache_salt),
        "platform_prefix_tokens": _i32([params.platform_prefix_tokens]),
        "stop_token_ids": _i32(sorted(params.stop_token_ids)),
        "conversation_id": _bytes(params.conversation_id or ""),
        "turn_id": _bytes(params.turn_id or ""),
        "request_id": _bytes(params.request_id),
    }


def command_of(get: Getter) -> Command:
    name = text_of(get, "command") or Command.GENERATE.value
    try:
        return Command(name)
    except ValueError:
        raise InvalidArgument(f"unknown command {name[:40]!r}") from None


def params_of(get: Getter) -> GenerateParams:
    """The GenerateParams of a generate request; InvalidArgument names the bad input."""
    prompt = get("prompt_token_ids")
    if prompt is None:
        raise InvalidArgument("prompt_token_ids is required")
    conversation = text_of(get, "conversation_id")
    turn = text_of(get, "turn_id")
    stops = get("stop_token_ids")
    return GenerateParams(
        prompt_token_ids=tuple(int(t) for t in prompt.reshape(-1)),
        max_tokens=_int(get, "max_tokens", 0),
        request_id=text_of(get, "request_id"),
        conversation_id=parse_conversation_id(conversation) if conversation else None,
        turn_id=parse_turn_id(turn) if turn else None,
        cache_salt=bytes_of(get, "cache_salt"),
        platform_prefix_tokens=_int(get, "platform_prefix_tokens"),
        sampling=SamplingParams(temperature=_float(get, "temperature"), top_p=_float(get, "top_p") or 1.0,
                                seed=_int(get, "seed")),
        stop_token_ids=frozenset(int(t) for t in stops.reshape(-1)) if stops is not None else frozenset(),
    )


# ---- responses ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Snapshot:
    """The engine's statistics at one moment; a later snapshot has a larger version (responses of different
    streams can arrive out of order, so the client keeps the newest)."""

    epoch: str  # one model instance's lifetime: versions restart when the model (re)loads
    version: int
    stats: EngineStats
    model: ModelIdentity | None = None  # the model the engine inside Triton serves


def stats_to_json(snapshot: Snapshot) -> str:
    stats = asdict(snapshot.stats)
    stats.pop("transfer", None)  # the replica outside Triton reports its own (it cannot transfer: backend.py)
    raw: dict[str, object] = {"epoch": snapshot.epoch, "version": snapshot.version, "stats": stats}
    if snapshot.model is not None:
        raw["model"] = asdict(snapshot.model)
    return json.dumps(raw, separators=(",", ":"))


def stats_from_json(text: str) -> Snapshot:
    raw = json.loads(text)
    stats = raw["stats"]
    stats.pop("transfer", None)
    stats["device"] = TierStats(**stats["device"])
    stats["host"] = TierStats(**stats["host"])
    model = ModelIdentity(**raw["model"]) if "model" in raw else None
    return Snapshot(str(raw["epoch"]), int(raw["version"]), EngineStats(**stats), model)


def event_tensors(event: GenerateEvent, snapshot: Snapshot | None = None) -> dict[str, Array]:
    """The outputs of one generation event, with the engine's statistics when given (on Started and Finished)."""
    out = _event_tensors(event)
    if snapshot is not None:
        out["stats_json"] = _bytes(stats_to_json(snapshot))
    return out


def _event_tensors(event: GenerateEvent) -> dict[str, Array]:
    match event:
        case Started():
            return {"event": _bytes(WireEvent.STARTED.value),
                    "cached_prompt_tokens": _i32([event.cached_tokens]),
                    "host_cached_prompt_tokens": _i32([event.host_cached_tokens])}
        case Delta():
            return {"event": _bytes(WireEvent.DELTA.value), "token_ids": _i32(event.token_ids),
                    "text": _bytes(event.text)}
        case Finished():
            u = event.usage
            return {"event": _bytes(WireEvent.FINISHED.value), "finish_reason": _bytes(event.reason.value),
                    "prompt_tokens": _i32([u.prompt_tokens]), "cached_prompt_tokens": _i32([u.cached_prompt_tokens]),
                    "output_tokens": _i32([u.output_tokens]), "error_message": _bytes(event.error)}
        case _:
            raise AssertionError(f"unknown event {event!r}")


def first_tensors(started: Started, delta: Delta, snapshot: Snapshot | None = None) -> dict[str, Array]:
    """Started and the first Delta as one response."""
    out = {**event_tensors(started, snapshot), **event_tensors(delta)}
    out["event"] = _bytes(WireEvent.FIRST.value)
    return out


def events_of(get: Getter) -> list[GenerateEvent]:
    """The generation events a response carries, in order (two for `first`)."""
    if kind_of(get) is WireEvent.FIRST:
        ids = get("token_ids")
        return [Started(cached_tokens=_int(get, "cached_prompt_tokens"),
                        host_cached_tokens=_int(get, "host_cached_prompt_tokens")),
                Delta(token_ids=tuple(int(t) for t in ids.reshape(-1)) if ids is not None else (),
                      text=text_of(get, "text"))]
    return [event_of(get)]


def error_tensors(err: CoreError | Exception) -> dict[str, Array]:
    """A refusal before the generation started."""
    match err:
        case InvalidArgument():
            kind = ErrorKind.INVALID_ARGUMENT
        case ResourceExhausted():
            kind = ErrorKind.RESOURCE_EXHAUSTED
        case _:
            kind = ErrorKind.INTERNAL
    return {"event": _bytes(WireEvent.ERROR.value), "error_kind": _bytes(kind.value),
            "error_message": _bytes(str(err) if isinstance(err, CoreError) else f"{type(err).__name__}: {err}")}


def stats_tensors(snapshot: Snapshot) -> dict[str, Array]:
    return {"event": _bytes(WireEvent.STATS.value), "stats_json": _bytes(stats_to_json(snapshot))}


def evicted_tensors(blocks: int) -> dict[str, Array]:
    return {"event": _bytes(WireEvent.EVICTED.value), "blocks_evicted": np.array([blocks], dtype=np.int64)}


def residency_tensors(epoch: str, r: Residency | None) -> dict[str, Array]:
    body: dict[str, object] = {"epoch": epoch, "supported": False} if r is None else {
        "epoch": epoch, "version": r.version, "full": r.full, "conversations": [list(c) for c in r.conversations]}
    return {"event": _bytes(WireEvent.RESIDENCY.value), "text": _bytes(json.dumps(body, separators=(",", ":")))}


def residency_of(get: Getter) -> tuple[str, Residency | None]:
    """The model instance's epoch and its residency changes (None: its engine cannot tell)."""
    body = json.loads(text_of(get, "text") or "{}")
    epoch = str(body.get("epoch", ""))
    if not body.get("supported", True):
        return epoch, None
    return epoch, Residency(int(body["version"]), bool(body["full"]),
                            tuple((ConversationId(str(c)), int(n)) for c, n in body["conversations"]))


def kind_of(get: Getter) -> WireEvent:
    return WireEvent(text_of(get, "event"))


def event_of(get: Getter) -> GenerateEvent:
    """The generation event a started/delta/finished response carries."""
    kind = kind_of(get)
    match kind:
        case WireEvent.STARTED:
            return Started(cached_tokens=_int(get, "cached_prompt_tokens"),
                           host_cached_tokens=_int(get, "host_cached_prompt_tokens"))
        case WireEvent.DELTA:
            ids = get("token_ids")
            return Delta(token_ids=tuple(int(t) for t in ids.reshape(-1)) if ids is not None else (),
                         text=text_of(get, "text"))
        case WireEvent.FINISHED:
            return Finished(reason=FinishReason(text_of(get, "finish_reason")),
                            usage=Usage(prompt_tokens=_int(get, "prompt_tokens"),
                                        cached_prompt_tokens=_int(get, "cached_prompt_tokens"),
                                        output_tokens=_int(get, "output_tokens")),
                            error=text_of(get, "error_message"))
        case WireEvent.FIRST | WireEvent.ERROR | WireEvent.STATS | WireEvent.EVICTED | WireEvent.RESIDENCY:
            raise ValueError(f"a {kind.value} response is not one generation event")
        case _:
            raise AssertionError(kind)


def error_of(get: Getter) -> CoreError | None:
    """The core error an `error` response reports (INTERNAL is None: the caller reports it its own way)."""
    kind = ErrorKind(text_of(get, "error_kind"))
    message = text_of(get, "error_message")
    match kind:
        case ErrorKind.INVALID_ARGUMENT:
            return InvalidArgument(message)
        case ErrorKind.RESOURCE_EXHAUSTED:
            return ResourceExhausted(message)
        case ErrorKind.INTERNAL:
            return None
        case _:
            raise AssertionError(kind)


def error_message_of(get: Getter) -> str:
    return text_of(get, "error_message")


def stats_of(get: Getter) -> Snapshot | None:
    text = text_of(get, "stats_json")
    return stats_from_json(text) if text else None


def blocks_evicted_of(get: Getter) -> int:
    return _int(get, "blocks_evicted")


def getter(tensors: Mapping[str, Array]) -> Getter:
    return tensors.get
