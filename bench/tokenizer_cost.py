"""What the model profile costs chat per turn: tokenizer encode speed and a turn's prompt render.

1. Encode, microseconds per token, for the same texts (this repository's Markdown and Python, cut into
   message-sized pieces of ~2 KB): chatmesh's BPE over SmolLM2's GGUF vocabulary (model/tokenizer.py, what the
   `smollm2` profile uses), Hugging Face `tokenizers` built from the same GGUF vocabulary and merges (the test
   oracle, tests/model/test_tokenizer.py), and `tokenizers` over Llama 3's tokenizer.json (the `llama3` profile).
   "cold": each piece's first encode in a fresh tokenizer (chatmesh's BPE caches words, so a new message costs
   this); "warm": the same pieces again.
2. A turn's render, milliseconds: the prompt of turn n of a conversation of `--turns` turns (every message
   ~`--message-chars` characters) re-rendered with the earlier turns' pieces already encoded (what chat does
   every turn: only the new message is new), for SmolLM2's built-in ChatML (the format chat used before the
   profile), SmolLM2's profile (its GGUF's own Jinja template, rendered sandboxed and split into segments), and
   Llama 3's profile (built-in Llama 3.1 format).

    .venv/bin/python -m bench.tokenizer_cost [--turns 20] [--message-chars 600] [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from chatmesh.mesh.config import Config
from chatmesh.model import profile, template
from chatmesh.model.assets import gguf_path
from chatmesh.model.settings import MODEL_DIR
from chatmesh.model.template import Message, PromptEncoder, Role
from chatmesh.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent


def corpus(piece_chars: int = 2000, limit_chars: int = 400_000) -> list[str]:
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted([*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"),
                                                                     *ROOT.glob("model/chatmesh/model/*.py")]))
    text = text[:limit_chars]
    return [text[i:i + piece_chars] for i in range(0, len(text), piece_chars)]


def per_token_us(encode: Callable[[str], list[int]], pieces: Sequence[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = sum(len(encode(p)) for p in pieces)
    return (time.perf_counter() - t0) / n * 1e6, n


def hf_from_gguf(model_dir: Path) -> Callable[[str], list[int]]:
    from tests.model.test_tokenizer import _hf

    hf = _hf(model_dir)
    return lambda text: hf.encode(text, add_special_tokens=False).ids


def conversation(turns: int, chars: int) -> list[Message]:
    words = ("the engine keeps each conversation history close at hand so that the next turn starts where the "
             "last one ended, café naïve 東京 2026 — “quoted” text and code: f(x) = x ** 2;").split()
    out = [Message(Role.SYSTEM, "You are a helpful, concise assistant. Answer the user's questions accurately.")]
    for t in range(turns):
        for role in (Role.USER, Role.ASSISTANT):
            text, i = "", 0
            while len(text) < chars:
                text += words[(t * 13 + i * 7 + (role is Role.USER)) % len(words)] + " "
                i += 1
            out.append(Message(role, f"{t}: {text.strip()}"))
    return out


def render_ms(render: Callable[[Sequence[Message]], object], messages: list[Message], reps: int) -> float:
    """Median time to render the last turn's prompt, the history before it encoded already."""
    render(messages[:-2])  # the earlier turns' pieces are in the encoder's cache, as on a real turn
    times = []
    for r in range(reps):
        fresh = [*messages[:-1], Message(Role.USER, f"{r} {messages[-2].text}")]  # a new message every time
        t0 = time.perf_counter()
        render(fresh)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--message-chars", type=int, default=600)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    model_dir = Path(Config()[MODEL_DIR])
    pieces = corpus()
    smollm2 = profile.load_spec("smollm2", model_dir)
    llama3 = profile.load_spec("llama3", model_dir)
    assert isinstance(smollm2.tokenizer, Tokenizer)
    print(f"encode: {len(pieces)} pieces, {sum(map(len, pieces)):,} characters")
    makers: list[tuple[str, Callable[[], Callable[[str], list[int]]]]] = [
        ("chatmesh BPE, SmolLM2 GGUF", lambda: Tokenizer.from_gguf(gguf_path(model_dir)).encode),
        ("tokenizers, SmolLM2 GGUF vocab", lambda: hf_from_gguf(model_dir)),
        ("tokenizers, Llama 3 tokenizer.json", lambda: profile.from_folder(llama3.source).encode)]
    for name, make in makers:
        encode = make()  # a fresh tokenizer: nothing cached
        cold, n = per_token_us(encode, pieces)
        warm, _ = per_token_us(encode, pieces)
        print(f"  {name:36s} {n:7,} tokens  cold {cold:5.2f} us/token  warm {warm:5.2f} us/token", flush=True)
    messages = conversation(args.turns, args.message_chars)
    builtin = PromptEncoder(smollm2.tokenizer)
    formats: list[tuple[str, Callable[[Sequence[Message]], object]]] = [
        ("SmolLM2, built-in ChatML (before)", lambda m: builtin.encode(template.SMOLLM2_FORMAT.format(m))),
        ("SmolLM2 profile (GGUF's Jinja)", smollm2.render),
        ("Llama 3 profile (built-in 3.1)", llama3.render)]
    print(f"render turn {args.turns} ({len(messages)} messages of ~{args.message_chars} chars), median of "
          f"{args.reps}, history cached:")
    for name, render in formats:
        prompt = render(messages)
        n = len(getattr(prompt, "token_ids"))
        print(f"  {name:36s} {n:6,} tokens  {render_ms(render, messages, args.reps):6.2f} ms/turn", flush=True)


if __name__ == "__main__":
    main()
