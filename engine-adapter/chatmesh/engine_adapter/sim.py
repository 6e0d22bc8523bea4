"""The `sim` backend: the real engine core (block manager, scheduler, streams) over an executor that computes
nothing and times each step with the roofline model (roofline.py) of the configured node.

Tokens: each sampled token is the next token of a deterministic English text (text.PASSAGE, encoded by the
CHATMESH_MODEL profile's tokenizer, so they are real ids of the served model: SmolLM2's, or Llama 3's with
CHATMESH_MODEL=llama3, and prompts and usage count in them), read at an offset chosen by
the seed and the token's position, so streams read as words and the same seed and prompt give the same reply.

Reply length (EOS). A real model ends its reply by sampling its end-of-turn token; `sim` does so after a length
drawn once per generation, uniformly from [mean / 2, 3 x mean / 2] (CHATMESH_SIM_REPLY_TOKENS, default 400: the
reference workload's reply), seeded by the request's seed and the prompt's length, so a retry with the same seed
ends where the first try did. A reply also ends at max_tokens (finish "length") or a requested stop token, as on
any engine. CHATMESH_SIM_REPLY_TOKENS=0 turns EOS off: replies run to max_tokens.

Scripted replies (CHATMESH_SIM_REPLIES, for tests). A list of rules `{"when": text, "reply": text}`: a prompt
whose last message (the tokens between its last two end-of-turn tokens, decoded; the generation header after
the last one left out) contains `when` is answered with `reply`, its special tokens' texts encoded as those
tokens (a script, unlike user text, may spell `<|python_tag|>`), then the end-of-turn token. The first
matching rule wins; other prompts get the passage text. Matching reads the prompt only (no state), so the same
rule answers on every replica and every retry, and a later turn whose last message no rule matches gets the
usual text.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from chatmesh.engine_adapter import settings
from chatmesh.engine_adapter.backend import Backend
from chatmesh.engine_adapter.block_manager import BlockConfig
from chatmesh.engine_adapter.engine import Clock, EngineCore, RealClock
from chatmesh.engine_adapter.executor import BlockCopy, SeqWork, StepResult
from chatmesh.engine_adapter.roofline import PRESETS, NodeModel
from chatmesh.engine_adapter.scheduler import SchedulerConfig
from chatmesh.engine_adapter.text import PASSAGE, TextCodec, WordCodec
from chatmesh.mesh import logs
from chatmesh.mesh.config import Config

log = logs.get("chatmesh.engine.sim")

DEFAULT_STEP_TOKENS = 512  # the reference's prefill chunk (Sarathi-Serve), which its step-time figures assume


@dataclass(frozen=True)
class ScriptedReply:
    """A rule of CHATMESH_SIM_REPLIES: a prompt whose last message contains `when` is answered `token_ids`."""

    when: str
    token_ids: tuple[int, ...]


class SimExecutor:
    """An Executor that samples from a script and reports roofline step times (or a fixed step time).

    `end_token`: the id that ends a reply (the model's end of turn); with `reply_tokens` > 0 every reply ends
    with it after its drawn length (module header). `scripted` replies need `prompt_of` (a sequence's prompt
    ids) and `last_message` (its last message's text); build_sim wires both."""

    name = "sim"

    def __init__(self, node: NodeModel, script: Sequence[int], block_size: int, fixed_step_s: float = 0.0, *,
                 end_token: int | None = None, reply_tokens: int = 0, scripted: Sequence[ScriptedReply] = (),
                 prompt_of: Callable[[int], Sequence[int]] | None = None,
                 last_message: Callable[[Sequence[int]], str] | None = None):
        if not script:
            raise ValueError("the sim script must not be empty")
        if (reply_tokens or scripted) and end_token is None:
            raise ValueError("sim needs an end token to end replies")
        if reply_tokens < 0:
            raise ValueError(f"sim reply length must be at least 0, got {reply_tokens}")
        self.node = node
        self.script = list(script)
        self.block_size = block_size
        self.fixed_step_s = fixed_step_s
        self.end_token = end_token
        self.reply_tokens = reply_tokens
        self.scripted = list(scripted)
        self.prompt_of = prompt_of
        self.last_message = last_message
        self._plans: dict[int, tuple[int, int, tuple[int, ...] | None]] = {}  # seq -> (prompt len, length, text)

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
        start = len(prompt) or end
        scripted = None
        if self.scripted and prompt and self.last_message is not None:
            text = self.last_message(prompt)
            scripted = next((r.token_ids for r in self.scripted if r.when in text), None)
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


def last_message_text(codec: TextCodec) -> Callable[[Sequence[int]], str]:
    """What a rule's `when` is matched against: the decoded tokens between the prompt's last two stop tokens."""
    stops = codec.stop_token_ids

    def text(prompt: Sequence[int]) -> str:
        ends = [i for i, t in enumerate(prompt) if t in stops][-2:]
        start, stop = (ends[0] + 1, ends[1]) if len(ends) == 2 else (0, ends[0] if ends else len(prompt))
        decoder = codec.decoder()
        return decoder.feed(prompt[start:stop]) + decoder.flush()

    return text


def parse_replies(value: str, codec: TextCodec) -> list[ScriptedReply]:
    """CHATMESH_SIM_REPLIES: the JSON itself when it starts with `[` (or `{`), else a file holding it."""
    if not value.strip():
        return []
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
    out = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, dict) and isinstance(rule.get("when"), str) and rule["when"]
                and isinstance(rule.get("reply"), str)):
            raise ValueError(f"CHATMESH_SIM_REPLIES rule {i} must be {{\"when\": non-empty text, \"reply\": text}}")
        out.append(ScriptedReply(rule["when"], encode_script(codec, rule["reply"])))
    return out


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
    executor = SimExecutor(node, codec.encode(PASSAGE), bs, cfg[settings.SIM_STEP_MS] / 1000,
                           end_token=end_token(codec), reply_tokens=cfg[settings.SIM_REPLY_TOKENS],
                           scripted=parse_replies(cfg[settings.SIM_REPLIES], codec),
                           last_message=last_message_text(codec))
    core = EngineCore(executor, blocks, sched, codec, replica_id=cfg[settings.REPLICA_ID],
                      flush_interval_s=cfg[settings.FLUSH_INTERVAL_MS] / 1000,
                      clock=clock or RealClock(cfg[settings.SIM_SPEED]))
    executor.prompt_of = lambda seq_id: core.scheduler.seq(seq_id).params.prompt_token_ids
    return core


def build_backend(cfg: Config) -> Backend:
    return build_sim(cfg)
