"""A small SSE reader for tests: parses `id`, `event`, `data` frames and comment lines from an httpx stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Frame:
    event: str
    id: str | None
    data: Any
    comment: str | None = None


async def frames(response: httpx.Response) -> AsyncIterator[Frame]:
    event, ident, data = "message", None, list[str]()
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield Frame(event, ident, json.loads("\n".join(data)))
            event, ident, data = "message", None, list[str]()
        elif line.startswith(":"):
            yield Frame("", None, None, comment=line[1:].strip())
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                event = value
            elif name == "id":
                ident = value
            elif name == "data":
                data.append(value)


async def collect(response: httpx.Response) -> list[Frame]:
    return [f async for f in frames(response) if f.comment is None]


def reply_text(events: list[Frame]) -> str:
    return "".join(f.data["text"] for f in events if f.event == "turn.delta")
