"""The shared logging (chatmesh.mesh.logs): exceptions, stdlib records and fields never carry secrets or text."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
import threading
from collections.abc import Iterator

import pytest
import structlog

from chatmesh.mesh import logs

MARKER = "zq-secret-marker-7781"


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    out = io.StringIO()
    hooks = (sys.excepthook, threading.excepthook)
    logs.configure("test", stream=out)
    yield out
    structlog.reset_defaults()
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    logging.captureWarnings(False)
    sys.excepthook, threading.excepthook = hooks


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]


def _fails(password: str, headers: dict[str, str]) -> None:
    body = {"password": password, "headers": headers}
    raise ValueError(f"bad body {body!r}")


def test_an_exception_is_its_type_and_place_never_its_message_or_locals(captured: io.StringIO) -> None:
    try:
        _fails(MARKER, {"authorization": f"Bearer {MARKER}"})
    except ValueError as exc:
        logs.get("t").error("unexpected_error", exc_info=exc)
    try:
        try:
            int(MARKER)
        except ValueError as inner:
            raise KeyError(MARKER) from inner
    except KeyError:
        logs.get("t").exception("chained")
    assert MARKER not in captured.getvalue()
    first, second = lines(captured)
    assert first["error_type"] == "ValueError" and first["service"] == "test"
    where = first["error_at"]
    assert isinstance(where, list) and any("_fails" in w for w in where)
    assert second["error_type"] == "KeyError" and second["error_cause"] == "ValueError"


def test_fields_that_name_secrets_or_text_are_dropped_and_long_strings_cut(captured: io.StringIO) -> None:
    logs.get("t").info("login", password=MARKER, authorization=MARKER, content=MARKER, headers={"x": MARKER},
                       owner_id="u-1", note="x" * 5000 + MARKER, nested={"cookie": MARKER, "n": 3},
                       raw=MARKER.encode())
    assert MARKER not in captured.getvalue()
    (line,) = lines(captured)
    assert line["owner_id"] == "u-1" and line["nested"] == {"n": 3}
    assert line["note"] == f"<{5000 + len(MARKER)} chars>"
    assert line["redacted"] == ["authorization", "content", "headers", "password", "raw"]


def test_stdlib_records_keep_their_template_and_numbers_only(captured: io.StringIO) -> None:
    try:
        raise RuntimeError(f"illegal header line: b'Authorization: Bearer {MARKER}'")
    except RuntimeError as exc:
        logging.getLogger("uvicorn.error").error("Exception in ASGI application\n%s", MARKER, exc_info=exc)
    logging.getLogger("hypercorn.error").warning("request %s took %d ms on %r", MARKER, 42, MARKER)
    logging.getLogger("grpc._cython.cygrpc").error(f"Unexpected error\nfuture: <Task exception=ValueError('{MARKER}')>")
    assert MARKER not in captured.getvalue()
    asgi, slow, grpc_line = lines(captured)
    assert asgi["event"] == "Exception in ASGI application" and asgi["error_type"] == "RuntimeError"
    assert asgi["logger"] == "uvicorn.error" and asgi["level"] == "error"
    assert slow["event"] == "request <str> took 42 ms on '<str>'"
    assert grpc_line["event"] == "Unexpected error"


def test_asyncio_unretrieved_task_exception_and_uncaught_exceptions(captured: io.StringIO) -> None:
    async def main() -> None:
        async def boom() -> None:
            raise ValueError(MARKER)

        task = asyncio.create_task(boom())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        # what the loop does when such a task is collected unretrieved
        asyncio.get_running_loop().call_exception_handler(
            {"message": "Task exception was never retrieved", "exception": task.exception(), "future": task})

    asyncio.run(main())
    try:
        raise OSError(MARKER)
    except OSError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)

    def worker() -> None:
        raise LookupError(MARKER)

    thread = threading.Thread(target=worker, name="w")
    thread.start()
    thread.join()
    assert MARKER not in captured.getvalue()
    found = {(line.get("event"), line.get("error_type")) for line in lines(captured)}
    assert ("Task exception was never retrieved", "ValueError") in found
    assert ("uncaught_exception", "OSError") in found
    assert ("uncaught_thread_exception", "LookupError") in found


def test_a_traceback_rendered_as_text_is_its_type_and_place(captured: io.StringIO) -> None:
    """Starlette hands uvicorn `traceback.format_exc()` when startup fails: the reason was lost (the line kept only
    "Traceback (most recent call last):"), and its message and source lines must not be written."""
    import traceback

    try:
        try:
            _fails(MARKER, {"cookie": MARKER})
        except ValueError as inner:
            raise RuntimeError(f"first line\n{MARKER}") from inner  # a message running on below its line
    except RuntimeError:
        text = traceback.format_exc()
    assert MARKER in text
    logging.getLogger("uvicorn.error").error(text)
    assert MARKER not in captured.getvalue()
    (line,) = lines(captured)
    assert line["event"] == "traceback" and line["error_type"] == "RuntimeError"
    where = line["error_at"]
    assert isinstance(where, list) and where and all(w.startswith("test_logs.py:") for w in where)
