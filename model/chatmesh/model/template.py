"""SmolLM2's ChatML chat template, rendered straight to token ids with stable prefixes.

The GGUF's template renders each message as `<|im_start|>{role}\\n{content}<|im_end|>\\n`, inserts a default
system message when the conversation has none, and ends with the generation prompt `<|im_start|>assistant\\n`.

Prefix stability (invariant I3): the engine reuses a conversation's cached KV blocks only if the next turn's
prompt tokens START WITH the previous turn's. Tokenizing the whole rendered string at once would not guarantee
that (BPE may merge across a message boundary), so every part is encoded on its own and concatenated: the
special tokens are inserted as ids, and a message's role header (`user\\n`), its content and the trailing `\\n`
are three separate encodings. The header is encoded apart from the content so that the generation prompt of
turn n (`<|im_start|>assistant\\n`) is also the exact start of the assistant message in turn n+1. The only
difference from tokenizing the rendered string whole is when content starts with whitespace, which then is not
merged into the newline before it: a model sees the same characters.

`platform_prefix_len` counts the tokens of the system message: the platform prefix the engine shares across
owners (the owner's salt enters the block hash chain after it).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from chatmesh.model.tokenizer import Tokenizer

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class Role(enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


@dataclass(frozen=True)
class Message:
    role: Role
    text: str


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: tuple[int, ...]
    platform_prefix_len: int  # leading tokens that are the system message


def message_ids(tok: Tokenizer, message: Message) -> list[int]:
    """One message's tokens: `<|im_start|>` + role header + content + `<|im_end|>` + newline."""
    return [tok.im_start_id, *tok.encode(message.role.value + "\n"), *tok.encode(message.text),
            tok.im_end_id, *tok.encode("\n")]


def generation_prompt_ids(tok: Tokenizer) -> list[int]:
    """`<|im_start|>assistant\\n`: the start of the reply the model is asked to write."""
    return [tok.im_start_id, *tok.encode(Role.ASSISTANT.value + "\n")]


def render(tok: Tokenizer, messages: Sequence[Message | tuple[Role | str, str]],
           add_generation_prompt: bool = True) -> RenderedPrompt:
    """Token ids of a conversation. A conversation without a leading system message gets the default one."""
    msgs = [m if isinstance(m, Message) else Message(Role(m[0]) if isinstance(m[0], str) else m[0], m[1])
            for m in messages]
    if not msgs or msgs[0].role is not Role.SYSTEM:
        msgs.insert(0, Message(Role.SYSTEM, DEFAULT_SYSTEM))
    ids = message_ids(tok, msgs[0])
    prefix_len = len(ids)
    for m in msgs[1:]:
        ids.extend(message_ids(tok, m))
    if add_generation_prompt:
        ids.extend(generation_prompt_ids(tok))
    return RenderedPrompt(tuple(ids), prefix_len)
