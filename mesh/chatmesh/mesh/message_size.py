"""The one size policy for a message (a user's message or a reply), enforced alike by the gateway, chat,
moderation and the store, so a message is either refused up front with a 400 that names the limit, or accepted
by every hop: never a 200 followed by a failure for size, and nothing stored for a refused one.

A message may be up to
- CHATMESH_MAX_MESSAGE_TOKENS tokens (128,000 by default: the reference design's long paste), and no more than
  the configured model takes as input (its context minus the reply tokens, within CHATMESH_PROMPT_CAP_TOKENS):
  the gateway counts a message's tokens when it could be over either (chatmesh.gateway.token_counts), and chat checks
  the whole prompt, history included, before the turn's first event;
- CHATMESH_MAX_MESSAGE_BYTES UTF-8 bytes (1 MiB by default): a bound on the work done before tokens are
  counted, and what moderation and the store accept. Ordinary text runs 2.5-4.5 bytes a token (chatmesh's own
  Markdown 2.7, English prose ~4.5), so a 128,000-token paste of it fits; a message above 8 bytes a token is
  refused by this bound before its tokens are counted.

Request bodies at the edge get CHATMESH_MAX_BODY_BYTES (4 MiB: a largest message plus JSON escaping).
"""

from __future__ import annotations

from dataclasses import dataclass

from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import InvalidArgument
from chatmesh.mesh.settings import MAX_MESSAGE_BYTES, MAX_MESSAGE_TOKENS


class MessageTooLong(InvalidArgument):
    """A message over the size policy; the message names the limit and the setting."""


@dataclass(frozen=True)
class MessageSize:
    max_tokens: int
    max_bytes: int

    @classmethod
    def from_config(cls, cfg: Config) -> MessageSize:
        return cls(cfg[MAX_MESSAGE_TOKENS], cfg[MAX_MESSAGE_BYTES])

    def check_bytes(self, text: str, what: str = "the message") -> int:
        """The UTF-8 size of `text`, or MessageTooLong when it is over the byte limit."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise MessageTooLong(f"{what} is {size:,} bytes; the limit is {self.max_bytes:,} bytes "
                                 "(CHATMESH_MAX_MESSAGE_BYTES)")
        return size

    def token_limit(self, model_input_tokens: int) -> int:
        """The most tokens a message may have with a model that takes `model_input_tokens` of input."""
        return min(self.max_tokens, model_input_tokens)

    def check_tokens(self, tokens: int, model_input_tokens: int) -> None:
        limit = self.token_limit(model_input_tokens)
        if tokens <= limit:
            return
        if limit == self.max_tokens:
            raise MessageTooLong(f"the message is {tokens:,} tokens; the limit is {limit:,} tokens "
                                 "(CHATMESH_MAX_MESSAGE_TOKENS)")
        raise MessageTooLong(f"the message is {tokens:,} tokens; this model takes at most {limit:,} tokens of input "
                             "(its context minus the reply tokens): shorten the message")
