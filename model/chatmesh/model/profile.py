"""The model profile: everything about the served model that chat and the engines must agree on, read from the
model's own files and chosen by one setting, CHATMESH_MODEL.

A profile holds the tokenizer, the chat format, the stop tokens, the context length and the model's identity
(its id and a digest of its tokenizer). Every part of the mesh that needs one loads it with `load(cfg)`: chat
renders and counts with it, `sim` counts, times and streams with it, `local` runs its GGUF, `triton` takes its
end ids and tokenizer folder from it, the edge counts with it.

CHATMESH_MODEL names:
- `smollm2` (default): the fetched SmolLM2-135M-Instruct GGUF (`chatmesh model fetch`);
- `llama3`: the fetched Llama 3 tokenizer folder (Llama 3.2's tokenizer.json: Llama 3.1's vocabulary);
- a path to a `.gguf` file: tokenizer from `tokenizer.ggml.*` (chatmesh's BPE, tokenizer.py), template from
  `tokenizer.chat_template`, context from `<arch>.context_length`, stops from the declared eos/eot ids;
- a path to a Hugging Face model folder: `tokenizer.json` (through `tokenizers`), `chat_template.jinja` or
  `tokenizer_config.json`'s `chat_template`, its `bos_token`/`eos_token`, context from config.json's
  `max_position_embeddings` or tokenizer_config.json's `model_max_length`, stops from config.json and
  generation_config.json's `eos_token_id`.

The chat format: the model's Jinja template when its files carry one (jinja_template.py), else a built-in one
chosen by the specials the vocabulary has: `<|start_header_id|>` with `<|eom_id|>` -> Llama 3.1's format,
without it -> Llama 3's, `<|im_start|>` -> ChatML. Stop tokens: the ids the files declare, the format's end of
turn, and every special token on the end-of-generation list (vocabulary.END_TOKEN_TEXTS) the vocabulary has.

Agreement: `check_agreement` compares the identity a prompt was rendered with to the one an engine serves;
token ids mean the same only under the same tokenizer digest, so that is what must match.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import FailedPrecondition
from chatmesh.model import assets, settings
from chatmesh.model.jinja_template import JinjaFormat
from chatmesh.model.template import (
    ChatFormat,
    ChatML,
    FormatError,
    Formatted,
    Llama3,
    Message,
    PromptEncoder,
    RenderedPrompt,
    Role,
    Special,
    Text,
    as_messages,
)
from chatmesh.model.tools import ToolCall, ToolDefinition, ToolSyntax, ToolsUnsupported
from chatmesh.model.vocabulary import END_TOKEN_TEXTS, IncrementalDecoder, TextTokenizer

BUILTIN = {"smollm2": "the fetched SmolLM2-135M-Instruct GGUF", "llama3": "the fetched Llama 3 tokenizer"}


class ProfileError(ValueError):
    """The model's files cannot make a profile (a missing or unusable part); the message says which."""


@dataclass(frozen=True)
class ModelIdentity:
    """Which model, and which tokenizer its token ids belong to."""

    model_id: str
    tokenizer_digest: str  # vocabulary.vocabulary_digest: "sha256:<hex>"

    def describe(self) -> str:
        return f"{self.model_id} (tokenizer {self.tokenizer_digest[:19]})"


class ModelMismatch(FailedPrecondition):
    """A prompt rendered for one tokenizer was sent to an engine serving another."""


def check_agreement(expected: ModelIdentity, served: ModelIdentity, replica: str) -> None:
    """Raises ModelMismatch naming both models unless their tokenizers are the same."""
    if expected.tokenizer_digest != served.tokenizer_digest:
        raise ModelMismatch(
            f"engine replica {replica} serves {served.describe()}, but chat rendered this prompt for "
            f"{expected.describe()}: set CHATMESH_MODEL to the same model on chat and every engine")


class ModelProfile:
    """A served model's tokenizer, chat format, stop tokens and context length (module header)."""

    def __init__(self, identity: ModelIdentity, tokenizer: TextTokenizer, chat_format: ChatFormat,
                 stop_token_ids: Iterable[int], context_tokens: int, source: Path,
                 tokenizer_dir: Path | None = None):
        self.identity = identity
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.stop_token_ids = frozenset(stop_token_ids)
        self.context_tokens = context_tokens
        self.source = source
        self.tokenizer_dir = tokenizer_dir  # a folder with tokenizer.json (what TensorRT-LLM loads), if any
        self._encoder = PromptEncoder(tokenizer)
        self._prefixes: dict[str, int] = {}
        self._encoder.encode(chat_format.format([Message(Role.USER, "")]))  # every special the format uses exists

    @property
    def model_id(self) -> str:
        return self.identity.model_id

    def render(self, messages: Sequence[Message | tuple[Role | str, str]], add_generation_prompt: bool = True,
               tools: Sequence[ToolDefinition] = (), prefill: str = "") -> RenderedPrompt:
        """The prompt's token ids and the platform prefix's length (template.py: boundaries and I3). With tools
        (or tool calls and results in the messages) in the model's own tool format; ToolsUnsupported, naming the
        model, when it has none. `prefill`: text the reply starts with (a required tool call's opening, tools.py),
        appended after the generation prompt as a piece of its own."""
        try:
            formatted = self.chat_format.format(as_messages(messages), add_generation_prompt, tools)
        except ToolsUnsupported as err:
            raise ToolsUnsupported(f"model {self.model_id} does not take tools: {err}") from None
        if prefill:
            formatted = Formatted((*formatted.segments, Text(prefill)), formatted.prefix_segments)
        return self._encoder.encode(formatted)

    @property
    def tool_syntax(self) -> ToolSyntax:
        """How the served model writes tool calls; ToolsUnsupported, naming the model, when it has no format."""
        syntax = self.chat_format.tool_syntax
        if syntax is None:
            problem = getattr(self.chat_format, "tools_problem", "") or \
                f"its chat format ({self.chat_format.name}) has no tool calls"
            raise ToolsUnsupported(f"model {self.model_id} does not take tools: {problem}")
        return syntax

    def platform_prefix_tokens(self, system_prompt: str) -> int:
        """Tokens of the platform prefix a conversation with this system prompt starts with."""
        n = self._prefixes.get(system_prompt)
        if n is None:
            n = self.render([Message(Role.SYSTEM, system_prompt), Message(Role.USER, "")]).platform_prefix_len
            if len(self._prefixes) < 64:
                self._prefixes[system_prompt] = n
        return n

    def count(self, text: str) -> int:
        """Tokens of plain text (a message's content, as the prompt will carry it)."""
        return len(self._encoder.text_ids(text))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(ids)

    def decoder(self) -> IncrementalDecoder:
        return self.tokenizer.decoder()


# ---- loading ---------------------------------------------------------------------------------------------------

def load(cfg: Config) -> ModelProfile:
    """The profile CHATMESH_MODEL names (loaded once per process per file). Raises assets.ModelMissing when a
    fetched model is absent, ProfileError when the files cannot make a profile."""
    return load_spec(cfg[settings.MODEL], cfg[settings.MODEL_DIR])


def resolve(spec: str, model_dir: str | Path) -> Path:
    """The file or folder a CHATMESH_MODEL value names."""
    match spec:
        case "smollm2":
            return assets.gguf_path(model_dir)
        case "llama3":
            return assets.llama3_tokenizer_dir(model_dir)
    path = Path(spec).expanduser()
    if not path.exists():
        raise assets.ModelMissing(f"CHATMESH_MODEL={spec}: no such file or folder (a .gguf file, a folder with "
                                  f"tokenizer.json, or one of {', '.join(BUILTIN)})")
    return path


def load_spec(spec: str, model_dir: str | Path) -> ModelProfile:
    return load_path(str(resolve(spec, model_dir).resolve()))


@functools.lru_cache(maxsize=4)
def load_path(path: str) -> ModelProfile:
    p = Path(path)
    if p.is_dir():
        return from_folder(p)
    from chatmesh.model import gguf_fields

    return from_gguf_fields(gguf_fields.read(p), p)


def from_gguf_reader(reader: Any, path: Path) -> ModelProfile:
    """A profile from an open `gguf.GGUFReader` (the local engine shares the reader of its weights)."""
    from chatmesh.model import gguf_fields

    return from_gguf_fields(gguf_fields.of_reader(reader), path)


def from_gguf_fields(fields: Mapping[str, object], path: Path) -> ModelProfile:
    """A profile from a GGUF's key-value fields (chatmesh.model.gguf_fields)."""
    from chatmesh.model.tokenizer import Tokenizer

    def field(name: str) -> object:
        return fields.get(name)

    tok = Tokenizer.from_fields(fields, str(path))
    arch = field("general.architecture")
    context = field(f"{arch}.context_length")
    if not isinstance(context, int):
        raise ProfileError(f"{path}: GGUF has no {arch}.context_length")
    declared = [v for k in ("eos", "eot", "eom") if isinstance(v := field(f"tokenizer.ggml.{k}_token_id"), int)]
    variables = {name: tok.token_text(v) for name in ("bos", "eos")
                 if isinstance(v := field(f"tokenizer.ggml.{name}_token_id"), int)}
    source = field("tokenizer.chat_template")
    fmt = _chat_format(tok, source if isinstance(source, str) else None,
                       {f"{k}_token": v for k, v in variables.items()}, path)
    return _profile(path.stem, tok, fmt, declared, context, path, None)


def from_folder(folder: Path) -> ModelProfile:
    """A profile from a Hugging Face model folder (module header)."""
    from chatmesh.model.tokenizer_json import JsonTokenizer

    if not (folder / "tokenizer.json").is_file():
        raise ProfileError(f"{folder}: no tokenizer.json")
    tok = JsonTokenizer.from_file(folder / "tokenizer.json")
    tconf = _json(folder / "tokenizer_config.json")
    mconf = _json(folder / "config.json")
    gconf = _json(folder / "generation_config.json")
    source = _template_source(folder, tconf)
    variables = {name: text for name in ("bos_token", "eos_token") if (text := _token_text(tconf.get(name)))}
    fmt = _chat_format(tok, source, variables, folder)
    context = mconf.get("max_position_embeddings") or tconf.get("model_max_length")
    if not isinstance(context, int) or context > 1 << 24:  # transformers writes 1e30 for "unknown"
        raise ProfileError(f"{folder}: no context length (config.json max_position_embeddings or "
                           "tokenizer_config.json model_max_length)")
    declared = [*_ids(mconf.get("eos_token_id")), *_ids(gconf.get("eos_token_id"))]
    eos = variables.get("eos_token", "")
    if eos in tok.special_tokens:
        declared.append(tok.special_tokens[eos])
    model_id = str(mconf.get("_name_or_path") or folder.name)
    return _profile(model_id, tok, fmt, declared, context, folder, folder)


def _profile(model_id: str, tok: TextTokenizer, fmt: ChatFormat, declared: Iterable[int], context: int,
             source: Path, tokenizer_dir: Path | None) -> ModelProfile:
    specials = tok.special_tokens
    stops = {*declared, *(specials[t] for t in END_TOKEN_TEXTS if t in specials)}
    if fmt.end_of_turn in specials:
        stops.add(specials[fmt.end_of_turn])
    try:
        return ModelProfile(ModelIdentity(model_id, tok.digest), tok, fmt, stops, context, source, tokenizer_dir)
    except FormatError as err:
        raise ProfileError(f"{source}: {err}") from None


def _chat_format(tok: TextTokenizer, source: str | None, variables: Mapping[str, str], where: Path) -> ChatFormat:
    specials = tok.special_tokens
    if source is not None:
        try:
            return checked_jinja(source, specials, variables)
        except FormatError as err:
            raise ProfileError(f"{where}: {err}") from None
    if "<|start_header_id|>" in specials:
        return Llama3(dated="<|eom_id|>" in specials)
    if "<|im_start|>" in specials:
        return ChatML()
    raise ProfileError(f"{where}: no chat_template, and no built-in format (ChatML, Llama 3) fits its special tokens")


PROBE = (Message(Role.SYSTEM, "Be brief."), Message(Role.USER, "  What is 2+2?  "),
         Message(Role.ASSISTANT, " 4. "), Message(Role.USER, "And 3+3?"))


def checked_jinja(source: str, specials: Mapping[str, int], variables: Mapping[str, str]) -> JinjaFormat:
    """A JinjaFormat that passed the probe checks of jinja_template.py's header, with its end-of-turn token
    found: the first special token after the assistant's content."""
    fmt = JinjaFormat(source, list(specials), end_of_turn="", variables=variables)
    for n in (2, 4):
        formatted = fmt.format(PROBE[:n])
        joined = "".join(s.token if isinstance(s, Special) else s.text for s in formatted.segments)
        if joined != fmt.render_text(PROBE[:n]):
            raise FormatError("chat_template output depends on message content in a way chatmesh cannot render "
                              "segment by segment")
    turn1, turn2 = fmt.format(PROBE[:2]).segments, fmt.format(PROBE[:4]).segments
    if turn2[:len(turn1)] != turn1:
        raise FormatError("chat_template is not prefix-stable: the next turn's prompt does not start with this "
                          "turn's (invariant I3)")
    reply = fmt.format(PROBE[:3], add_generation_prompt=False).segments
    content = {Text(PROBE[2].text), Text(PROBE[2].text.strip())}
    at = max((i for i, s in enumerate(reply) if s in content), default=len(reply))
    after = reply[at + 1:]
    fmt.end_of_turn = next((s.token for s in after if isinstance(s, Special)), variables.get("eos_token", ""))
    if fmt.tool_syntax is not None:
        try:
            _check_tools(fmt)
        except FormatError as err:
            fmt.tool_syntax, fmt.tools_problem = None, str(err)
    return fmt


PROBE_TOOL = ToolDefinition.of({"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
PROBE_TOOLS = (Message(Role.SYSTEM, "Be brief."), Message(Role.USER, "Weather in Paris?"),
               Message(Role.ASSISTANT, "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
               Message(Role.TOOL, '{"celsius": 21}', tool_call_id="call_1"))


def _check_tools(fmt: JinjaFormat) -> None:
    """A tool round trip renders segment by segment as the template prints it, prefix-stably (I3)."""
    tools = (PROBE_TOOL,)
    for n in (2, 4):
        joined = "".join(s.token if isinstance(s, Special) else s.text
                         for s in fmt.format(PROBE_TOOLS[:n], tools=tools).segments)
        if joined != fmt.render_text(PROBE_TOOLS[:n], tools=tools):
            raise FormatError("its chat template renders tools in a way chatmesh cannot render segment by segment")
    turn1 = fmt.format(PROBE_TOOLS[:2], tools=tools).segments
    if fmt.format(PROBE_TOOLS, tools=tools).segments[:len(turn1)] != turn1:
        raise FormatError("its chat template renders a tool round trip that is not prefix-stable (invariant I3)")


def _template_source(folder: Path, tconf: Mapping[str, Any]) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    source = tconf.get("chat_template")
    if isinstance(source, list):  # named templates: take the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    return source if isinstance(source, str) else None


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ProfileError(f"{path}: not JSON ({err})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _ids(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []
