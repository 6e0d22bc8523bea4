"""The `sim` backend: the real engine core (block manager, scheduler, streams) over an executor that computes
nothing and times each step with the roofline model (roofline.py) of the configured node.

Tokens: each sampled token is the next token of a deterministic English text (text.PASSAGE, encoded by the
CHATMESH_MODEL profile's tokenizer, so they are real ids of the served model: SmolLM2's, or Llama 3's with
CHATMESH_MODEL=llama3, and prompts and usage count in them), read at an offset chosen by
the seed and the token's position, so streams read as words and the same seed and prompt give the same reply.

Reply length (EOS). A real model ends its reply by sampling its end-of-turn token; `sim` does so after a length
drawn once per generation, uniformly from [mean / 2, 3 x mean / 2] (CHATMESH_SIM_REPLY_TOKENS, default 400: the
reference workload's reply), seeded by the request's seed and the prompt's length, so a retry with the same seed
ends where the first try did. A continued reply (`resumed_tokens`: the prompt ends with reply already shown)
draws its length from the prompt without those tokens and counts them as output, so it ends where the reply it
continues would have; its tokens, read by seed and position, are the ones that reply had. A reply also ends at max_tokens (finish "length") or a requested stop token, as on
any engine. CHATMESH_SIM_REPLY_TOKENS=0 turns EOS off: replies run to max_tokens.

Scripted replies (CHATMESH_SIM_REPLIES, for tests). A list of rules `{"when": text, "reply": text}` or
`{"when": text, "tool_calls": [{"name": N, "arguments": {...}}]}` (with an optional "reply" before the calls):
a prompt whose last message (the tokens between its last two end-of-turn tokens, decoded; the generation
header after the last one left out) contains `when` is answered with `reply`, its special tokens' texts encoded
as those tokens (a script, unlike user text, may spell `<|python_tag|>`), or with the calls written in the
served model's own format (model/tools.py: Llama 3.1's JSON, ChatML's `<tool_call>` blocks), then the
end-of-turn token. When the prompt already ends with the start of that reply (chat prefilled a required tool
call's opening), the reply continues from there, as a model would. The first matching rule wins; other prompts
get the passage text. Matching reads the prompt only (no state), so the same rule answers on every replica and
every retry, and a later turn whose last message no rule matches gets the usual text.

Prefix pulls (issue 29): sim blocks hold no data, so a pull moves empty payloads over the real PullPrefix RPC
(hashes, digests, the source's pinning and owner checks all real) and the puller waits out the modelled
transfer: bytes = tokens x the preset's KV bytes per token, over `chatmesh.router.link.Link` (bandwidth and
per-transfer latency from CHATMESH_SIM_LINK_GBPS x CHATMESH_SIM_LINK_NICS and CHATMESH_SIM_LINK_LATENCY_MS;
defaults the reference's node, 8 x 400 Gb/s, 0.5 ms), so TTFT shows it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatmesh.engine_adapter import settings
from chatmesh.engine_adapter.backend import Backend
from chatmesh.engine_adapter.block_manager import BlockConfig
from chatmesh.engine_adapter.engine import Clock, EngineCore, RealClock
from chatmesh.engine_adapter.executor import BlockCopy, KvFormat, SeqWork, StepResult, Tier
from chatmesh.engine_adapter.roofline import PRESETS, NodeModel
from chatmesh.engine_adapter.scheduler import SchedulerConfig
from chatmesh.engine_adapter.text import PASSAGE, TextCodec, WordCodec
from chatmesh.mesh import logs
from chatmesh.mesh.config import Config
from chatmesh.router.link import Link

log = logs.get("chatmesh.engine.sim")

DEFAULT_STEP_TOKENS = 512  # the reference's prefill chunk (Sarathi-Serve), which its step-time figures assume


@dataclass(frozen=True)
class ScriptedReply:
    """A rule of CHATMESH_SIM_REPLIES: a prompt whose last message contains `when` is answered `text`."""

    when: str
    text: str


class Script:
    """The scripted replies (module header): which prompt gets which tokens."""

    def __init__(self, codec: TextCodec, rules: Sequence[ScriptedReply]):
        self.codec = codec
        self.rules = list(rules)
        self._stops = codec.stop_token_ids
        self._encoded: dict[str, tuple[int, ...]] = {}

    def reply(self, prompt: Sequence[int]) -> tuple[int, ...] | None:
        """The scripted reply's tokens for this prompt, or None when no rule matches its last message."""
        ends = [i for i, t in enumerate(prompt) if t in self._stops][-2:]
        start, stop = (ends[0] + 1, ends[1]) if len(ends) == 2 else (0, ends[0] if ends else len(prompt))
        text = self._text(prompt[start:stop])
        rule = next((r for r in self.rules if r.when in text), None)
        if rule is None:
            return None
        tail = self._text(prompt[stop + 1:]) if ends else ""  # the generation prompt, and any prefill after it
        begun = max((k for k in range(2, len(rule.text) + 1) if tail.endswith(rule.text[:k])), default=0)
        rest = rule.text[begun:]
        if rest not in self._encoded:
            self._encoded[rest] = encode_script(self.codec, rest)
        return self._encoded[rest]

    def _text(self, ids: Sequence[int]) -> str:
        decoder = self.codec.decoder()
        return decoder.feed(ids) + decoder.flush()


class SimExecutor:
    """An Executor that samples from a script and reports roofline step times (or a fixed step time).

    `end_token`: the id that ends a reply (the model's end of turn); with `reply_tokens` > 0 every reply ends
    with it after its drawn length (module header). Scripted `replies` need `prompt_of` (a sequence's prompt ids);
    build_sim wires both."""

    name = "sim"

    def __init__(self, node: NodeModel, script: Sequence[int], block_size: int, fixed_step_s: float = 0.0, *,
                 end_token: int | None = None, reply_tokens: int = 0, replies: Script | None = None,
                 prompt_of: Callable[[int], Sequence[int]] | None = None, link: Link | None = None,
                 resumed_of: Callable[[int], int] | None = None):
        if not script:
            raise ValueError("the sim script must not be empty")
        if (reply_tokens or replies) and end_token is None:
            raise ValueError("sim needs an end token to end replies")
        if reply_tokens < 0:
            raise ValueError(f"sim reply length must be at least 0, got {reply_tokens}")
        self.node = node
        self.script = list(script)
        self.block_size = block_size
        self.fixed_step_s = fixed_step_s
        self.end_token = end_token
        self.reply_tokens = reply_tokens
        self.replies = replies
        self.prompt_of = prompt_of
        self.resumed_of = resumed_of  # a sequence's resumed tokens (reply already shown at the prompt's end)
        self._plans: dict[int, tuple[int, int, tuple[int, ...] | None]] = {}  # seq -> (prompt len, length, text)
        self.link = link or Link()
        self._format = KvFormat("none", block_size * node.plan.kv_bytes_per_token, 0)

    def execute(self, work: Sequence[SeqWork]) -> StepResult:
        kv_read = prefill = 0
        next_tokens: dict[int, int] = {}
        script, n_script = self.script, len(self.script)
        plans, eos = self._plans, self.end_token
        for w in work:
            n = len(w.token_ids)
            end = w.start_pos + n
            kv_read += end
            if n > 1:
                prefill += n
            if not w.sample:
                continue
            if eos is not None:
                start, length, scripted = plans.get(w.seq_id) or self._plan(w.seq_id, end, w.sampling.seed)
                k = end - start  # output position of the token sampled now
                if scripted is not None:
                    next_tokens[w.seq_id] = scripted[k] if k < len(scripted) else eos
                    continue
                if length and k >= length:
                    next_tokens[w.seq_id] = eos
                    continue
            next_tokens[w.seq_id] = script[(w.sampling.seed * 7919 + end) % n_script]
        duration = self.fixed_step_s or self.node.step_s(prefill, kv_read)
        return StepResult(next_tokens, duration)

    def _plan(self, seq_id: int, end: int, seed: int) -> tuple[int, int, tuple[int, ...] | None]:
        """A generation's reply, fixed at its first sample: where its output starts, its drawn length, and its
        scripted tokens if a rule matched."""
        prompt = self.prompt_of(seq_id) if self.prompt_of is not None else ()
        scripted = self.replies.reply(prompt) if self.replies is not None and prompt else None
        # A scripted reply continues from what the prompt already holds of it (Script.reply); the passage's reply
        # starts where the prompt did before the resumed tokens.
        resumed = self.resumed_of(seq_id) if self.resumed_of is not None and scripted is None else 0
        start = (len(prompt) or end) - resumed
        length = 0
        if self.reply_tokens:
            low = max(1, self.reply_tokens // 2)
            length = random.Random(seed * 1_000_003 + start).randint(low, max(low, self.reply_tokens * 3 // 2))
        plan = (start, length, scripted)
        self._plans[seq_id] = plan
        return plan

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> float:
        return 0.0 if self.fixed_step_s else self.node.copy_s(len(copies), self.block_size)

    def release(self, seq_id: int) -> None:
        self._plans.pop(seq_id, None)

    @property
    def kv_format(self) -> KvFormat:
        return self._format

    def export_blocks(self, blocks: Sequence[tuple[Tier, int]]) -> list[bytes]:
        return [b""] * len(blocks)

    def import_blocks(self, blocks: Sequence[int], payloads: Sequence[bytes]) -> None:
        pass

    def transfer_s(self, nbytes: int) -> float:
        return self.link.transfer_s(nbytes)


def end_token(codec: TextCodec) -> int:
    """The id a sim reply ends with: the chat format's end of turn when the codec is a model profile, else its
    smallest stop id."""
    from chatmesh.model.profile import ModelProfile

    if isinstance(codec, ModelProfile):
        eot = codec.tokenizer.special_tokens.get(codec.chat_format.end_of_turn)
        if eot is not None and eot in codec.stop_token_ids:
            return eot
    return min(codec.stop_token_ids)


def _specials(codec: TextCodec) -> Mapping[str, int]:
    from chatmesh.model.profile import ModelProfile

    return codec.tokenizer.special_tokens if isinstance(codec, ModelProfile) else {}


def encode_script(codec: TextCodec, text: str) -> tuple[int, ...]:
    """A scripted reply's ids: its special tokens' texts as those tokens, the rest as plain text."""
    specials = _specials(codec)
    out: list[int] = []
    pos = 0
    names = sorted(specials, key=len, reverse=True)
    while pos < len(text):
        at, name = min(((i, s) for s in names if (i := text.find(s, pos)) >= 0), default=(len(text), ""))
        if at > pos:
            out += codec.encode(text[pos:at])
        if name:
            out.append(specials[name])
        pos = at + len(name)
    return tuple(out)


def parse_replies(value: str, codec: TextCodec) -> Script | None:
    """CHATMESH_SIM_REPLIES: the JSON itself when it starts with `[` (or `{`), else a file holding it."""
    if not value.strip():
        return None
    source = value
    if not value.lstrip().startswith(("[", "{")):
        try:
            source = Path(value).expanduser().read_text(encoding="utf-8")
        except OSError as err:
            raise ValueError(f"CHATMESH_SIM_REPLIES: cannot read {value}: {err.strerror}") from None
    try:
        rules = json.loads(source)
    except json.JSONDecodeError as err:
        raise ValueError(f"CHATMESH_SIM_REPLIES is not JSON: {err}") from None
    if not isinstance(rules, list):
        raise ValueError("CHATMESH_SIM_REPLIES must be a JSON list of {\"when\", \"reply\"} rules")
    return Script(codec, [_rule(i, rule, codec) for i, rule in enumerate(rules)])


def _rule(i: int, rule: Any, codec: TextCodec) -> ScriptedReply:
    shape = '{"when": non-empty text, "reply": text} or {"when": ..., "tool_calls": [{"name", "arguments"}]}'
    if not (isinstance(rule, dict) and isinstance(rule.get("when"), str) and rule["when"]
            and isinstance(rule.get("reply", ""), str) and ("reply" in rule or "tool_calls" in rule)):
        raise ValueError(f"CHATMESH_SIM_REPLIES rule {i} must be {shape}")
    text: str = rule.get("reply", "")
    calls = rule.get("tool_calls")
    if calls is None:
        return ScriptedReply(rule["when"], text)
    from chatmesh.model.profile import ModelProfile
    from chatmesh.model.tools import HERMES, ToolsUnsupported

    if not isinstance(codec, ModelProfile):
        raise ValueError(f"CHATMESH_SIM_REPLIES rule {i}: tool calls need the model's tokenizer (CHATMESH_SIM_TEXT)")
    if not (isinstance(calls, list) and calls and all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments", {}), dict)
            for c in calls)):
        raise ValueError(f"CHATMESH_SIM_REPLIES rule {i}: tool_calls must be a list of {{\"name\", \"arguments\"}}")
    try:
        syntax = codec.tool_syntax
    except ToolsUnsupported as err:
        raise ValueError(f"CHATMESH_SIM_REPLIES rule {i}: {err}") from None
    written = [syntax.call_text(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False)) for c in calls]
    if syntax is not HERMES and (len(written) > 1 or text):
        raise ValueError(f"CHATMESH_SIM_REPLIES rule {i}: {syntax.name} writes one call per reply and no text")
    return ScriptedReply(rule["when"], "\n".join([text, *written] if text else written))


def codec_for(cfg: Config) -> TextCodec:
    """The CHATMESH_MODEL profile when CHATMESH_SIM_TEXT allows and its files are there, else the word codec."""
    choice = cfg[settings.SIM_TEXT]
    if choice == "words":
        return WordCodec()
    from chatmesh.model import assets, profile

    try:
        return profile.load(cfg)
    except assets.ModelMissing:
        if choice == "tokenizer":
            raise
        log.warning("sim_text_words", reason="model file absent; sim streams use the word codec")
        return WordCodec()


def build_sim(cfg: Config, *, codec: TextCodec | None = None, clock: Clock | None = None) -> EngineCore:
    node = PRESETS[cfg[settings.SIM_PRESET]]
    bs = cfg[settings.BLOCK_SIZE]
    device = cfg[settings.DEVICE_BLOCKS]
    host = cfg[settings.HOST_BLOCKS]
    blocks = BlockConfig(bs, device if device >= 0 else int(node.kv_tokens // bs),
                         host if host >= 0 else int(node.host_kv_tokens // bs))
    sched = SchedulerConfig(cfg[settings.MAX_BATCH], settings.step_token_budget(cfg, DEFAULT_STEP_TOKENS),
                            cfg[settings.QUEUE_LIMIT])
    codec = codec or codec_for(cfg)
    link = Link.from_gbps(cfg[settings.SIM_LINK_GBPS], cfg[settings.SIM_LINK_NICS],
                          cfg[settings.SIM_LINK_LATENCY_MS] / 1000)
    executor = SimExecutor(node, codec.encode(PASSAGE), bs, cfg[settings.SIM_STEP_MS] / 1000,
                           end_token=end_token(codec), reply_tokens=cfg[settings.SIM_REPLY_TOKENS],
                           replies=parse_replies(cfg[settings.SIM_REPLIES], codec), link=link)
    core = EngineCore(executor, blocks, sched, codec, replica_id=cfg[settings.REPLICA_ID],
                      flush_interval_s=cfg[settings.FLUSH_INTERVAL_MS] / 1000,
                      clock=clock or RealClock(cfg[settings.SIM_SPEED]), pulls=settings.pull_config(cfg))
    executor.prompt_of = lambda seq_id: core.scheduler.seq(seq_id).params.prompt_token_ids
    executor.resumed_of = lambda seq_id: core.scheduler.seq(seq_id).params.resumed_tokens
    return core


def build_backend(cfg: Config) -> Backend:
    return build_sim(cfg)
