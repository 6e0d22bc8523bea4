"""A reply's stream: engine events relayed into the live turn, each chunk screened before the user sees it.

`relay` runs one generation on the picked replica and returns how it ended: the engine finished it
(`EngineFinished`), output moderation blocked it (`OutputBlocked`), this process stopped it (`StoppedHere`: a stop
request or the caller going away; the engine sequence is cancelled by closing its stream), or the stream ended
without a finish (`StreamCut`). It moves the turn's state machine through PREFILL and DECODE as the engine admits
the prompt and tokens arrive; the lifecycle (`claimed.py`) makes the final move and the store write.

Text reaches the live turn, and so the user, only after its chunk passed the output check; what the user saw is
exactly `live.text`, which is what a stop stores. Each engine event is one flushed chunk (many tokens), so the
check and the publish cost is per chunk, not per token.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import assert_never

from chatmesh.chat.events import Delta, LiveTurn
from chatmesh.chat.ports import (
    EngineDelta, EngineFinished, EnginePort, EngineStarted, Generation, ModerationPort, OutputScreen, Screening,
)
from chatmesh.mesh.turn import TurnMachine, TurnState, Usage


@dataclass(frozen=True)
class OutputBlocked:
    verdict: Screening


@dataclass(frozen=True)
class StoppedHere:
    """Stopped by this process (stop request or disconnect), not by the engine."""


@dataclass(frozen=True)
class StreamCut:
    """The engine stream ended without a finish event."""


Ending = EngineFinished | OutputBlocked | StoppedHere | StreamCut


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
                address: str, generation: Generation, timeout_s: float) -> tuple[Ending, Tally]:
    tally = Tally(prompt_tokens=len(generation.prompt_token_ids))
    screen = await moderation.open_output(generation.conversation)
    consume = asyncio.create_task(_consume(engines, live, machine, address, generation, timeout_s, screen, tally))
    stop = asyncio.create_task(live.stop_requested.wait())
    try:
        await asyncio.wait({consume, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not consume.done():  # stop or disconnect: cancel the engine sequence, keep what the user saw
            consume.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consume
        await screen.close()
    return (StoppedHere() if consume.cancelled() else consume.result()), tally


async def _consume(engines: EnginePort, live: LiveTurn, machine: TurnMachine, address: str, generation: Generation,
                   timeout_s: float, screen: OutputScreen, tally: Tally) -> Ending:
    stream = engines.generate(address, generation, timeout_s)
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
                    if text:
                        verdict = await screen.check(text)
                        if verdict.blocked:
                            return OutputBlocked(verdict)
                        await live.publish(Delta(text))
                case EngineFinished(output_tokens=output):
                    tally.output_tokens = max(tally.output_tokens, output)
                    return event
                case _:
                    assert_never(event)
        return StreamCut()
    finally:
        await stream.aclose()
