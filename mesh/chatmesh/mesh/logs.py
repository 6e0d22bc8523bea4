"""Logs that cannot leak: one JSON line per event, carrying ids and counts, never secrets or message text, on
every path, error paths included. Every chatmesh process logs through `configure()`; nothing else in the tree
configures logging.

What this module guarantees, for chatmesh's own structlog events and for every stdlib logger in the process
(uvicorn's and hypercorn's error logs, grpc, asyncio's "exception was never retrieved", SQLAlchemy, warnings):

- An exception is written as `error_type` (its class, e.g. `json.decoder.JSONDecodeError`), `error_at` (the
  innermost frames as `file.py:line function`: code locations only) and `error_cause` (the class of what it was
  raised from), never as its message or a rendered traceback. A message can quote input (`invalid literal for
  int(): '<the input>'`, h11's `illegal header line: b'Authorization: ...'`), and a traceback renderer that shows
  frame locals (structlog's `dict_tracebacks` does by default) writes the request's headers and body.
- A stdlib record keeps the first line of its format string; of its %-arguments only numbers and booleans are
  written, anything else becomes `<type>`. (asyncio writes the repr of the failed task, with its exception's
  message, on the lines after the first.)
- Fields whose name says secret or text (`password`, `authorization`, `cookie`, `headers`, `body`, `content`,
  `text`, ...: `REDACTED_KEYS`) are dropped and listed in `redacted`; any other string over `MAX_VALUE_CHARS`
  characters is replaced by its length. These two are a backstop: chatmesh code logs ids and counts by intent.
- Uncaught exceptions (`sys.excepthook`, `threading.excepthook`) go through the same path instead of Python's
  default traceback printer.

What stays the caller's job: never put text into a field under an innocent name. The log-leak test
(tests/e2e/test_log_leaks.py) drives the error paths of a whole mesh with markers in passwords, keys, cookies
and messages, and checks that no line of any service's log holds one.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import sys
import threading
import traceback
from collections.abc import Mapping, MutableMapping
from types import TracebackType
from typing import IO, Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

REDACTED_KEYS = frozenset({
    "password", "passwd", "secret", "api_key", "key", "authorization", "cookie", "cookies", "set_cookie",
    "headers", "header", "body", "raw", "content", "text", "message", "prompt", "reply", "partial_text", "delta",
    "query", "query_string", "form", "json", "csrf_token", "session", "token",
})
MAX_VALUE_CHARS = 1000  # longer than any reason chatmesh writes; shorter than a pasted body
FRAMES = 4  # innermost frames named in `error_at`

def _exception_of(value: object) -> BaseException | None:
    if isinstance(value, BaseException):
        return value
    if value is True:
        return sys.exc_info()[1]
    if isinstance(value, tuple) and len(value) == 3 and isinstance(value[1], BaseException):
        return value[1]
    return None


def _class_name(exc: BaseException) -> str:
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _where(exc: BaseException) -> list[str]:
    frames = list(traceback.walk_tb(exc.__traceback__))[-FRAMES:]
    return [f"{os.path.basename(frame.f_code.co_filename)}:{line} {frame.f_code.co_name}" for frame, line in frames]


def exception_fields(exc: BaseException) -> dict[str, object]:
    """What a log line says about an exception: its class and where it was raised, nothing it carries."""
    out: dict[str, object] = {"error_type": _class_name(exc), "error_at": _where(exc)}
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is not None:
        out["error_cause"] = _class_name(cause)
    return out


def _scrub(value: object, depth: int = 0) -> object:
    if isinstance(value, str):
        return value if len(value) <= MAX_VALUE_CHARS else f"<{len(value)} chars>"
    if isinstance(value, bool | int | float) or value is None:
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return f"<{len(value)} bytes>"
    if isinstance(value, BaseException):
        return _class_name(value)
    if depth < 2 and isinstance(value, list | tuple | set | frozenset):
        return [_scrub(v, depth + 1) for v in list(value)[:50]]
    if depth < 2 and isinstance(value, Mapping):
        return {str(k): _scrub(v, depth + 1) for k, v in list(value.items())[:50]
                if str(k).lower() not in REDACTED_KEYS}
    if isinstance(value, enum.Enum):
        return value.name
    return f"<{type(value).__name__}>"


def scrub(_logger: object, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """The structlog processor that enforces the rules of the module header."""
    for name in ("exc_info", "exception"):
        if name in event_dict:
            exc = _exception_of(event_dict.pop(name))
            if exc is not None:
                event_dict.update(exception_fields(exc))
    event_dict.pop("stack_info", None)
    event_dict.pop("stack", None)
    redacted = [k for k in event_dict if k.lower() in REDACTED_KEYS]
    for k in redacted:
        del event_dict[k]
    for k, v in list(event_dict.items()):
        if k != "redacted":
            event_dict[k] = _scrub(v)
    if redacted:
        event_dict["redacted"] = sorted(redacted)
    return event_dict


def _safe_arg(arg: object) -> object:
    if isinstance(arg, bool | int | float) or arg is None:
        return arg
    return f"<{type(arg).__name__}>"


_TRACEBACK = "Traceback (most recent call last):"
_FRAME_LINE = re.compile(r'^\s*File "([^"]+)", line (\d+), in ([\w<>.]+)\s*$')
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


def traceback_fields(text: str) -> dict[str, object]:
    """A traceback already rendered as text (Starlette hands uvicorn `traceback.format_exc()` when startup
    fails) as `error_type` and `error_at`: the last exception's class and the innermost code locations. Its
    messages and source lines are dropped, as for a live exception."""
    lines = text.strip().splitlines()
    matches = [(i, m) for i, m in enumerate(map(_FRAME_LINE.match, lines)) if m]
    out: dict[str, object] = {"error_at": [f"{os.path.basename(m[1])}:{m[2]} {m[3]}" for _, m in matches][-FRAMES:]}
    # the exception's line is the first unindented one after the last frame (its message may run on below it)
    after = (line for line in lines[matches[-1][0] + 1:] if not line[:1].isspace()) if matches else iter(())
    exception = _EXCEPTION_LINE.match(next(after, ""))
    if exception is not None:
        out["error_type"] = exception[1]
    return out


def record_event(record: logging.LogRecord) -> dict[str, Any]:
    """A stdlib record as an event dict: the first line of its template, numeric arguments only (a rendered
    traceback as its exception's class and code locations)."""
    template = record.msg if isinstance(record.msg, str) else f"<{type(record.msg).__name__}>"
    if template.startswith(_TRACEBACK):
        rendered: dict[str, Any] = {"event": "traceback", "logger": record.name,
                                    "level": record.levelname.lower(), **traceback_fields(template)}
        if record.exc_info:
            rendered["exc_info"] = record.exc_info
        return rendered
    text = template
    if record.args:
        args = record.args
        safe: object = ({k: _safe_arg(v) for k, v in args.items()} if isinstance(args, Mapping)
                        else tuple(_safe_arg(a) for a in args))
        try:
            text = template % safe
        except (TypeError, ValueError, KeyError):
            text = template
    out: dict[str, Any] = {"event": text.strip().splitlines()[0] if text.strip() else "",
                           "logger": record.name, "level": record.levelname.lower()}
    if record.exc_info:
        out["exc_info"] = record.exc_info
    return out


class _Pipeline:
    """The processors every line goes through, for structlog events and stdlib records alike."""

    def __init__(self, service: str, json: bool) -> None:
        self.service = service
        self.renderer: structlog.typing.Processor = (
            # human-readable lines quote every string value (repr), so no value can pass for another field
            structlog.processors.JSONRenderer() if json else
            structlog.dev.ConsoleRenderer(colors=False, repr_native_str=True))
        self.stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)

    def add_service(self, _logger: object, _method: str, event_dict: MutableMapping[str, Any]
                    ) -> MutableMapping[str, Any]:
        event_dict.setdefault("service", self.service)
        return event_dict

    def render(self, event_dict: MutableMapping[str, Any]) -> str:
        event_dict = structlog.contextvars.merge_contextvars(None, "", event_dict)
        event_dict = self.add_service(None, "", event_dict)
        event_dict = self.stamp(None, "", event_dict)
        event_dict = scrub(None, "", event_dict)
        line = self.renderer(None, "", event_dict)
        return line if isinstance(line, str) else str(line)


class _StdlibHandler(logging.Handler):
    """Writes stdlib records (uvicorn, hypercorn, grpc, asyncio, ...) through the pipeline."""

    def __init__(self, pipeline: _Pipeline, stream: IO[str]) -> None:
        super().__init__()
        self._pipeline = pipeline
        self._stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self._pipeline.render(record_event(record))
            self._stream.write(line + "\n")
            self._stream.flush()
        except Exception:  # a logging failure must not take the process down, nor print the record
            pass


def configure(service: str, level: str = "info", json: bool = True, stream: TextIO | None = None) -> None:
    """Sets up logging for this process (see the module header). `stream` defaults to standard error."""
    out = stream if stream is not None else sys.stderr
    pipeline = _Pipeline(service, json)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            pipeline.add_service,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            scrub,
            pipeline.renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(_StdlibHandler(pipeline, out))
    root.setLevel(max(_LEVELS[level], logging.INFO))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "hypercorn.error", "hypercorn.access"):
        named = logging.getLogger(name)
        for handler in list(named.handlers):
            named.removeHandler(handler)
        named.propagate = True
    logging.captureWarnings(True)
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook


def _excepthook(cls: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(cls, KeyboardInterrupt):
        return
    get("chatmesh.crash").error("uncaught_exception", exc_info=exc)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
        get("chatmesh.crash").error("uncaught_thread_exception", thread=args.thread.name if args.thread else "",
                                    exc_info=args.exc_value)


def get(name: str) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger
