"""A reply's stream: engine events relayed into the live turn, each chunk screened before the user sees it.

`relay` runs one generation on the picked replica and returns how it ended: the engine finished it
(`EngineFinished`), output moderation blocked it (`OutputBlocked`), this process stopped it (`StoppedHere`: a stop
request or the caller going away; the engine sequence is cancelled by closing its stream), or the stream ended
without a finish (`StreamCut`). It moves the turn's state machine through PREFILL and DECODE as the engine admits
the prompt and tokens arrive; the lifecycle (`claimed.py`) makes the final move and the store write.

Stop strings (a turn's `TurnOptions.stop`): the text is scanned as it streams; the part of a chunk that could be
the start of a stop string is held back until the next chunk decides, and when one appears the reply ends just
before it (`StopString`: the engine sequence is cancelled, the turn completes with finish reason "stop"), so the
stop string is neither sent nor stored.

Tool calls (a turn with tools, `Calls`): after the output check, the text goes through the served model's call
reader (chatmesh.model.tools), which holds back what may be a call as a stop string is held, and the calls it reads
are published as `ToolCalled` events (after all the text: text the model writes after a call is dropped). What was
held and is no call comes out as text at the end, so nothing the model wrote and the check passed is lost.

Text reaches the live turn, and so the user, only after its chunk passed the output check; what the user saw is
exactly `live.text`, which is what a stop stores. Each engine event is one flushed chunk (many tokens), so the
check and the publish cost is per chunk, not per token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import assert_never

from chatmesh.chat.admission import judged
from chatmesh.chat.events import TurnDelta, LiveTurn, ToolCalled
from chatmesh.chat.ports import (
    EngineDelta, EngineFinished, EnginePort, EngineStarted, Generation, ModerationPort, OutputScreen, Screening,
)
from chatmesh.mesh.turn import TurnMachine, TurnState, Usage
from chatmesh.model.tools import CallScanner, ParsedCall, ToolCall


@dataclass(frozen=True)
class OutputBlocked:
    verdict: Screening


@dataclass(frozen=True)
class StoppedHere:
    """Stopped by this process (stop request or disconnect), not by the engine."""


@dataclass(frozen=True)
class StreamCut:
    """The engine stream ended without a finish event."""


@dataclass(frozen=True)
class StopString:
    """A stop string appeared: the reply ends just before it."""


Ending = EngineFinished | OutputBlocked | StoppedHere | StreamCut | StopString


class StopScan:
    """Finds the first of `stops` in streamed text; holds back a tail that may be the start of one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text that may go out now, and whether a stop string ended the reply (nothing after it goes)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self.held = ""
            return buf[:min(found)], True
        keep = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


class Calls:
    """A reply's tool-call reader: text in, text and calls out (the module header). `call_id(i)` names call i."""

    def __init__(self, scanner: CallScanner, call_id: Callable[[int], str], prefill: str = ""):
        self.scanner = scanner
        self.call_id = call_id
        if prefill:  # the reply's opening, already in the prompt: read as the model's own
            scanner.feed(prefill)

    async def publish(self, live: LiveTurn, text: str, final: bool) -> None:
        pieces = self.scanner.feed(text) if text else []
        if final:
            pieces += self.scanner.finish()
        for piece in pieces:
            if isinstance(piece, ParsedCall):
                i = len(live.calls)
                await live.publish(ToolCalled(ToolCall(self.call_id(i), piece.name, piece.arguments), i))
            elif piece and not live.calls:
                await live.publish(TurnDelta(piece))


@dataclass
class Tally:
    """What the engine reported so far: the turn's usage."""

    prompt_tokens: int
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.cached_tokens, self.output_tokens)


async def relay(engines: EnginePort, moderation: ModerationPort, live: LiveTurn, machine: TurnMachine,
                address: str, generation: Generation, timeout_s: float, stops: tuple[str, ...] = (),
                calls: Calls | None = None) -> tuple[Ending, Tally]:
    tally = Tally(prompt_tokens=len(generation.prompt_token_ids))
    if live.stop_requested.is_set():  # stopped before the engine was asked (e.g. while rerouting): not started
        return StoppedHere(), tally
    screen = await moderation.open_output(generation.conversation)
    consume = asyncio.create_task(_consume(engines, live, machine, address, generation, timeout_s, screen, tally,
                                           StopScan(stops), calls))
    stop = asyncio.create_task(live.stop_requested.wait())
    try:
        await asyncio.wait({consume, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not consume.done():  # stop or disconnect: cancel the engine sequence, keep what the user saw
            consume.cancel()
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await consume  # raises the engine's failure, if that is how it ended
        finally:
            await screen.close()  # the reply's moderation window, also after a failure
    return (StoppedHere() if consume.cancelled() else consume.result()), tally


async def _consume(engines: EnginePort, live: LiveTurn, machine: TurnMachine, address: str, generation: Generation,
                   timeout_s: float, screen: OutputScreen, tally: Tally, scan: StopScan, calls: Calls | None
                   ) -> Ending:
    stream = engines.generate(address, generation, timeout_s)

    async def send(text: str, final: bool = False) -> Screening | None:
        """Screens and publishes `text` (`final`: the reply's last); the verdict when it was blocked."""
        if text:
            verdict = judged(await screen.check(text))
            if verdict.blocked:
                return verdict
        if calls is not None:
            await calls.publish(live, text, final)
        elif text:
            await live.publish(TurnDelta(text))
        return None

    try:
        async for event in stream:
            match event:
                case EngineStarted(cached_prompt_tokens=cached):
                    machine.advance(TurnState.PREFILL)
                    tally.cached_tokens = cached
                case EngineDelta(text=text, token_count=count):
                    if machine.state is TurnState.PREFILL:
                        machine.advance(TurnState.DECODE)
                    tally.output_tokens += count
                    out, stopped = scan.feed(text)
                    if (verdict := await send(out, final=stopped)) is not None:
                        return OutputBlocked(verdict)
                    if stopped:
                        return StopString()
                case EngineFinished(output_tokens=output):
                    tally.output_tokens = max(tally.output_tokens, output)
                    if (verdict := await send(scan.flush(), final=True)) is not None:
                        return OutputBlocked(verdict)
                    return event
                case _:
                    assert_never(event)
        return StreamCut()
    finally:
        await stream.aclose()
