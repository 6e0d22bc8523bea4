"""A turn's prompt: the stored conversation replayed through the context builder, and summaries at turn boundaries.

`context.build` fixes the order (system prompt, stored summary, recent turns verbatim, the new message) so prompt
n+1 starts with prompt n plus reply n (I3). This module decides what is replayed (not superseded replies, not
blocked turns, not the reply being regenerated) and when older turns are summarised: when the replayed history
passes `summary_threshold_tokens`, the turns before the last `keep_recent_messages` messages are summarised by the
engine at the turn boundary, before the prompt is built, and the summary is stored; later turns rebuild the same
prompt from the stored summary instead of recomputing it.

The threshold (`summary_threshold`): unless set, the reference's 12,000 tokens where the served model has the
room, else half the prompt room (the model's context less the reply budget: SmolLM2's 8,192 - 256 = 7,936, so
3,968), so a conversation is summarised well before its prompt can stop fitting; a setting above the prompt room
could never fire first and is refused at start-up (`ThresholdRefused`). A conversation that still outgrows the
room (a long paste among the recent messages, a long new message) is summarised further before the turn
(`prompt_for`): first all but the last `keep_recent_messages // 2` messages, then all of it (a regenerate keeps the
message it answers), so a turn fails as too long only when its new message alone cannot fit, never for the
conversation's length. The summariser's own prompt is held to the context: a transcript too long for it is cut
in the middle of its longest messages (`transcript`).

A turn's allowance (chat.proto's prompt_token_allowance, or an internal client's per-turn budget) is refused
before any engine work, summaries included: before the first summary a turn would write, its plan is made again
with stand-in summaries as long as one can be (`STAND_IN`, SUMMARY_MAX_TOKENS words) and no engine call
(`_check_allowance`); a turn that could end over its allowance is refused then, the size checked in the trailer.
The price is a conservative refusal, by at most one summary's length, of a turn that summarises right at the edge
of its allowance; a turn that would fold more than once is refused only when even its least prompt is over.

The prefix cache (I1): every generation names its owner (`Generation.owner`), and the engine derives the owner's
cache salt from it (and, with mutual TLS, only from a verified owner token), so one owner's turns reuse each
other's KV past the platform prefix and two owners never share it. Chat holds no salt secret.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from chatmesh.chat import context
from chatmesh.chat.options import ChatOptions
from chatmesh.chat.ports import EngineDelta, Generation, Ports
from chatmesh.mesh import errors, logs
from chatmesh.mesh.config import SettingRefused
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId
from chatmesh.model.tools import ToolDefinition, ToolResult
from chatmesh.store.values import History, MessageStatus, Role

log = logs.get("chatmesh.chat")

DEFAULT_SYSTEM_PROMPTS = {
    "v1": "You are a helpful, concise assistant. Answer the user's questions accurately and briefly.",
}
SUMMARY_PROMPT = ("You summarise conversations. Write a short factual summary of the conversation below, keeping "
                  "names, numbers, decisions and open questions. Write only the summary.")
SUMMARY_MAX_TOKENS = 200
REFERENCE_THRESHOLD_TOKENS = 12_000  # the reference: "when history passes 12,000 tokens it is summarized"
SUMMARY_PROMPT_OVERHEAD = 64  # the summariser prompt's instructions and chat-format tokens, above its transcript


class ThresholdRefused(SettingRefused):
    """CHATMESH_SUMMARY_THRESHOLD_TOKENS set above the prompt room: a prompt would stop fitting before it fired."""


def summary_threshold(limits: context.PromptLimits, setting: int) -> int:
    """The summary threshold for these limits: the setting, or (0) the one derived from the model's room."""
    room = context.prompt_room(limits)
    if setting > room:
        raise ThresholdRefused(
            f"CHATMESH_SUMMARY_THRESHOLD_TOKENS is {setting}, above the prompt room of {room} tokens (the served "
            f"model's context {limits.context_tokens} minus {limits.reply_tokens} reply tokens, cap "
            f"{limits.prompt_cap_tokens}): conversations would stop fitting before they were summarised. Set it "
            f"below {room}, or to 0 to derive it ({min(REFERENCE_THRESHOLD_TOKENS, room // 2)} here)")
    return setting or min(REFERENCE_THRESHOLD_TOKENS, room // 2)


def clipped(text: str, chars: int) -> str:
    """`text` within `chars` characters, its middle left out."""
    if len(text) <= chars:
        return text
    half = max(1, chars // 2)
    return f"{text[:half]} [...] {text[len(text) - half:]}"

_SPEAKERS = {Role.SYSTEM: context.Speaker.SYSTEM, Role.USER: context.Speaker.USER,
             Role.ASSISTANT: context.Speaker.ASSISTANT, Role.TOOL: context.Speaker.TOOL}


def stored_summary(view: History) -> context.PromptSummary | None:
    if view.summary is None or not view.summary.text:
        return None
    return context.PromptSummary(view.summary.text, view.summary.covers_through_index + 1)


def history(view: History, regenerates: TurnId | None = None) -> list[context.HistoryMessage]:
    """Stored messages as the prompt replays them: superseded and blocked ones are not replayed, nor the reply
    being regenerated."""
    blocked_turns = {m.turn_id for m in view.messages if m.status is MessageStatus.BLOCKED}
    return [context.HistoryMessage(
        index=m.index, speaker=_SPEAKERS[m.role], content=m.content, turn_id=m.turn_id,
        replayable=(not m.superseded and m.turn_id not in blocked_turns
                    and not (regenerates and m.turn_id == regenerates and m.role is Role.ASSISTANT)),
        tool_calls=m.tool_calls, tool_results=m.tool_results)
        for m in view.messages]


def transcript_line(m: context.HistoryMessage) -> str:
    """A message as the summary's transcript shows it (tool calls and results included, as text)."""
    if m.tool_results:
        return "tool: " + "\n".join(r.content for r in m.tool_results)
    calls = "".join(f" [called {c.name}({c.arguments})]" for c in m.tool_calls)
    return f"{m.speaker.value}: {m.content}{calls}"


STAND_IN = " ".join(["summary"] * SUMMARY_MAX_TOKENS)  # at least as many tokens as a summary can have


@dataclass(frozen=True)
class Built:
    """A prompt's plan: the prompt (None: too long for the room even after every summary it could make, `too_long`
    says by how much), how many summaries it made, and the last."""

    rendered: context.Rendered | None
    folds: int
    summary: context.PromptSummary | None
    too_long: context.PromptTooLong | None = None


Fold = Callable[[context.PromptSummary | None, int], Awaitable[context.PromptSummary | None]]


@dataclass(frozen=True)
class Compacted:
    """A summary just stored (or found stored), with what writing it cost."""

    summary: context.PromptSummary
    token_count: int  # of the summary text
    prompt_tokens: int  # of the prompt that wrote it (0: it was already stored)


class Prompts:
    def __init__(self, ports: Ports, renderer: context.Renderer, count_tokens: Callable[[str], int],
                 options: ChatOptions):
        self.store, self.router, self.engines = ports.store, ports.router, ports.engines
        self.renderer = renderer
        self.count_tokens = count_tokens
        self.opt = options

    def render(self, view: History, summary: context.PromptSummary | None, new_message: str | None,
               regenerates: TurnId | None = None, instructions: str = "", reply_tokens: int | None = None,
               new_results: Sequence[ToolResult] = (), tools: Sequence[ToolDefinition] = (), prefill: str = ""
               ) -> context.Rendered:
        return context.build(self.renderer, self.opt.limits, self._system_prompt(view), summary,
                             history(view, regenerates), new_message, instructions, reply_tokens, new_results,
                             tools, prefill)

    async def next_prompt(self, owner: OwnerId, conv: ConversationId, new_message: str) -> context.Rendered:
        """The prompt the next turn with `new_message` would send (no summarising side effect)."""
        view = await self.store.read_conversation(owner, conv)
        return self.render(view, stored_summary(view), new_message)

    async def prompt_for(self, owner: OwnerId, conv: ConversationId, view: History, new_message: str | None,
                         regenerates: TurnId | None, instructions: str, reply_tokens: int,
                         new_results: Sequence[ToolResult] = (), tools: Sequence[ToolDefinition] = (),
                         prefill: str = "", threshold: int | None = None, allowance: int = 0) -> context.Rendered:
        """A turn's prompt, summarising first as the module header says (at the threshold, the turn's own when it
        sets one, then as far as the prompt needs to fit); PromptTooLong only when the turn's own message cannot
        fit. With an `allowance` (the most prompt tokens the turn may use), a turn that would summarise first is
        checked before the summary is written (`_check_allowance`), so PromptOverAllowance comes before any
        engine work."""
        least = 2 if regenerates is not None else 0  # a regenerate keeps the user message it answers

        def render(summary: context.PromptSummary | None) -> context.Rendered:
            return self.render(view, summary, new_message, regenerates, instructions, reply_tokens, new_results,
                               tools, prefill)

        checked = not allowance

        async def fold(summary: context.PromptSummary | None, keep: int) -> context.PromptSummary | None:
            nonlocal checked
            if not checked:  # the first summary this turn would write: first, whether the turn can then run
                checked = True
                await self._check_allowance(view, render, least, threshold, allowance)
            folded = await self._fold(owner, conv, view, summary, keep)
            return folded.summary if folded is not None else None

        built = await self._build(view, render, least, threshold, fold)
        if built.rendered is None:
            assert built.too_long is not None
            raise built.too_long
        return built.rendered

    async def _build(self, view: History, render: Callable[[context.PromptSummary | None], context.Rendered],
                     least: int, threshold: int | None, fold: Fold) -> Built:
        """The prompt's plan: the stored summary refreshed when the replayed history is over the threshold (the
        turn's own, Responses' context_management; else the service's), then further while the prompt does not
        fit the room, each summary by `fold` (which writes one, or stands one in)."""
        summary = stored_summary(view)
        folds = 0

        async def step(keep: int) -> None:
            nonlocal summary, folds
            folded = await fold(summary, keep)
            if folded is not None:
                summary, folds = folded, folds + 1

        counts = {m.index: m.token_count for m in view.messages}
        limit = threshold if threshold is not None else self.opt.summary_threshold_tokens
        if context.history_tokens(history(view), summary, counts) > limit:
            await step(self.opt.keep_recent_messages)
        for keep in sorted({max(least, self.opt.keep_recent_messages // 2), least}, reverse=True):
            try:
                return Built(render(summary), folds, summary)
            except context.PromptTooLong:
                await step(keep)
        try:
            return Built(render(summary), folds, summary)
        except context.PromptTooLong as err:
            return Built(None, folds, summary, err)

    async def _check_allowance(self, view: History, render: Callable[[context.PromptSummary | None], context.Rendered],
                               least: int, threshold: int | None, allowance: int) -> None:
        """PromptOverAllowance unless the turn's prompt, once summarised, is sure to be within `allowance`, judged
        on the plan made with stand-in summaries as long as a summary can be (`STAND_IN`), without engine work.
        One summary: the prompt is at most the plan's (a conservative refusal, by at most a summary's length).
        Several, or one after which the prompt still does not fit the room: the real, shorter summaries may stop
        the folding earlier, at any size within the room, so only the least the prompt can be is certain (the
        deepest fold, its summary empty): over the allowance, refused; else the turn goes on, and the exact check
        after rendering (`claimed.py`) is the only one. The trailer names the size checked."""

        async def stand_in(summary: context.PromptSummary | None, keep: int) -> context.PromptSummary | None:
            cut = context.summary_cut(history(view), summary, keep)
            return None if cut is None else context.PromptSummary(STAND_IN, cut)

        planned = await self._build(view, render, least, threshold, stand_in)
        if planned.summary is None or planned.folds == 0:  # nothing to summarise: no engine work comes
            return
        if planned.folds == 1 and planned.rendered is not None:
            bound = len(planned.rendered.token_ids)
        else:
            bound = len(render(replace(planned.summary, text="")).token_ids)  # PromptTooLong: too long anyway
        if bound > allowance:
            raise errors.PromptOverAllowance(bound, allowance)

    async def compact(self, owner: OwnerId, conv: ConversationId, expect_last: TurnId | None) -> Compacted:
        """Summarises the whole conversation, through its last reply, and stores that as its summary (the
        Responses API's compaction): `_fold` keeping nothing. The next turn's prompt is then built like any after
        a summary: the system prompt, the stored summary, the new message. Compacting again with nothing new
        returns the stored summary."""
        view = await self.store.read_conversation(owner, conv)
        live = [m for m in view.messages if not m.superseded]
        if not live or live[-1].role is not Role.ASSISTANT:
            raise errors.FailedPrecondition("nothing to compact: the conversation does not end with a reply")
        if expect_last is not None and live[-1].turn_id != expect_last:
            raise errors.FailedPrecondition("the conversation has moved on since that response: compact its last one")
        summary = stored_summary(view)
        folded = await self._fold(owner, conv, view, summary, 0)
        if folded is None:  # the stored summary covers every message already
            assert summary is not None and view.summary is not None
            return Compacted(summary, view.summary.token_count, 0)
        return folded

    async def _fold(self, owner: OwnerId, conv: ConversationId, view: History, summary: context.PromptSummary | None,
                    keep: int) -> Compacted | None:
        """Summarises the replayed history but its last `keep` messages into a new stored summary (None: there
        is nothing more to summarise)."""
        replayed = history(view)
        cut = context.summary_cut(replayed, summary, keep)
        if cut is None:
            return None
        start = summary.covers_until if summary else 0
        lines = [transcript_line(m) for m in replayed if start <= m.index < cut and m.replayable]
        text, prompt_tokens = await self._summarise(owner, conv,
                                                    self.transcript(summary.text if summary else "", lines))
        saved = await self.store.save_summary(owner, conv, text, cut - 1, self.count_tokens(text))
        log.info("summary_stored", conversation_id=conv, covers_through_index=cut - 1, kept_messages=keep)
        return Compacted(context.PromptSummary(saved.text, saved.covers_through_index + 1), saved.token_count,
                         prompt_tokens)

    def transcript(self, earlier: str, lines: list[str]) -> str:
        """What the summariser reads: the earlier summary and the messages (`transcript_line`), within its
        context (the longest messages cut in the middle when the whole would not fit)."""
        budget = self.opt.limits.context_tokens - SUMMARY_MAX_TOKENS - SUMMARY_PROMPT_OVERHEAD
        head = f"Earlier summary: {earlier}\n" if earlier else ""

        def joined(chars: int | None) -> str:
            return head + "\n".join(clipped(line, chars) if chars else line for line in lines)

        text = joined(None)
        tokens = self.count_tokens(text)
        longest = max((len(line) for line in lines), default=0)
        for _ in range(8):  # each round cuts the longest messages to a share of what is over
            if tokens <= budget or longest < 16:
                break
            longest = int(longest * max(0.1, min(0.8, budget / tokens)))
            text = joined(longest)
            tokens = self.count_tokens(text)
        return text

    def _system_prompt(self, view: History) -> str:
        version = view.conversation.system_prompt_version or self.opt.default_prompt_version
        prompt = self.opt.system_prompts.get(version)
        if prompt is None:
            raise errors.FailedPrecondition(f"system prompt version {version!r} is not configured")
        return prompt

    async def _summarise(self, owner: OwnerId, conv: ConversationId, transcript: str) -> tuple[str, int]:
        """The engine's summary of `transcript`, and the tokens of the prompt that asked for it."""
        rendered = self.renderer.render([(context.Speaker.SYSTEM, SUMMARY_PROMPT), (context.Speaker.USER, transcript)])
        pick = await self.router.pick(conv)
        parts: list[str] = []
        try:
            stream = self.engines.generate(pick.address, Generation(
                request_id=f"summary-{conv}", conversation=conv, turn=None, owner=owner,
                prompt_token_ids=rendered.token_ids, platform_prefix_tokens=rendered.platform_prefix_tokens,
                max_tokens=SUMMARY_MAX_TOKENS, temperature=0.0, top_p=1.0, source=pick.source),
                self.opt.engine_deadline_s)
            try:
                async for event in stream:
                    if isinstance(event, EngineDelta):
                        parts.append(event.text)
            finally:
                await stream.aclose()
        finally:
            with contextlib.suppress(errors.CoreError):
                await self.router.release(pick.lease)
        text = "".join(parts).strip()
        if not text:
            raise errors.Unavailable("the engine returned an empty summary; retry the turn")
        return text, len(rendered.token_ids)
