"""The moderation policy: categories, how each is scored, and the thresholds that turn scores into actions.

A category is scored by regex rules (each match gives the rule's fixed score, optionally only when a validator
such as the Luhn checksum accepts the matched text) and/or by a model score (the embedded profanity classifier,
later a guard model), the category's score being the highest of them. Each category has two thresholds per
direction: at `flag_at` the action is FLAG, at `block_at` it is BLOCK; `null` in the JSON means "never". A
verdict's action is the most severe over all categories; categories scoring at least `report_at` are reported.

The policy is a JSON file (setting CHATMESH_MODERATION_POLICY_FILE); the built-in default is
`data/default_policy.json` beside this module, which doubles as the documented example of the format:

    {"report_at": 0.2, "window_chars": 96, "context_tokens": 12,
     "categories": {"payment_card": {"flag_at": 0.5, "block_at": 0.9,
                                     "rules": [{"name": "card", "regex": "...", "score": 1.0,
                                                "validator": "luhn", "gate": ["0", "1", "..."]}]},
                    "profanity": {"model": "profanity", "flag_at": {"input": 0.8, "output": 0.6},
                                  "block_at": {"input": null, "output": 0.9}}}}
"""

from __future__ import annotations

import enum
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, assert_never

from chatmesh.mesh.errors import InvalidArgument


class Action(enum.IntEnum):
    """What moderation decides, ordered by severity so the most severe wins with `max`."""

    ALLOW = 1
    FLAG = 2
    BLOCK = 3


class Direction(enum.Enum):
    """Which way the text flows: a user's message in, or the model's reply out."""

    INPUT = "input"
    OUTPUT = "output"


class FailureMode(enum.Enum):
    """What a direction does when its check cannot finish: fail closed (block) or fail open (allow)."""

    CLOSED = "closed"
    OPEN = "open"

    @property
    def action(self) -> Action:
        match self:
            case FailureMode.CLOSED:
                return Action.BLOCK
            case FailureMode.OPEN:
                return Action.ALLOW
            case _ as unreachable:
                assert_never(unreachable)


class Validator(enum.Enum):
    """A check on a regex match before it counts."""

    NONE = "none"
    LUHN = "luhn"


class PolicyError(InvalidArgument):
    """The policy file is malformed."""


def luhn_ok(digits: str) -> bool:
    """The Luhn (mod 10) checksum used by payment card numbers."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def card_number_ok(text: str) -> bool:
    """A plausible payment card number: 13-19 digits, a known issuer prefix, a valid Luhn checksum."""
    digits = "".join(ch for ch in text if ch.isdigit())
    if not 13 <= len(digits) <= 19 or len(set(digits)) == 1:
        return False
    issuer = (digits[0] in "45" or digits[:2] in ("30", "34", "35", "36", "37", "38", "39", "62", "65")
              or digits[:4] == "6011" or 2221 <= int(digits[:4]) <= 2720)
    return issuer and luhn_ok(digits)


def validate(validator: Validator, text: str) -> bool:
    match validator:
        case Validator.NONE:
            return True
        case Validator.LUHN:
            return card_number_ok(text)
        case _ as unreachable:
            assert_never(unreachable)


@dataclass(frozen=True)
class Rule:
    """One pattern of a category: a match (accepted by the validator) scores `score`. `gate` lists literals
    one of which any match must contain (lower-cased), so most text skips the regex."""

    name: str
    pattern: re.Pattern[str]
    score: float
    validator: Validator = Validator.NONE
    gate: tuple[str, ...] = ()


@dataclass(frozen=True)
class Thresholds:
    """Scores at which a category flags and blocks in one direction; None means never."""

    flag_at: float | None
    block_at: float | None

    def action(self, score: float) -> Action:
        if self.block_at is not None and score >= self.block_at:
            return Action.BLOCK
        if self.flag_at is not None and score >= self.flag_at:
            return Action.FLAG
        return Action.ALLOW


@dataclass(frozen=True)
class Category:
    """A named kind of violation, its rules, the model score it reads (if any) and its thresholds."""

    name: str
    rules: tuple[Rule, ...]
    model: str | None
    on_input: Thresholds
    on_output: Thresholds

    def thresholds(self, direction: Direction) -> Thresholds:
        match direction:
            case Direction.INPUT:
                return self.on_input
            case Direction.OUTPUT:
                return self.on_output
            case _ as unreachable:
                assert_never(unreachable)


@dataclass(frozen=True)
class Policy:
    """The whole policy. `window_chars` of judged reply text are kept so a phrase split across chunks is seen
    whole; `context_tokens` benign tokens before a chunk's new words dilute the classifier like a sentence."""

    categories: tuple[Category, ...]
    report_at: float = 0.2
    window_chars: int = 96
    context_tokens: int = 12

    @property
    def models(self) -> frozenset[str]:
        return frozenset(c.model for c in self.categories if c.model is not None)

    @functools.cached_property
    def _gate_literals(self) -> tuple[str, ...]:
        return tuple(sorted({g for c in self.categories for r in c.rules for g in r.gate}))

    def gates_in(self, lowered: str) -> frozenset[str]:
        """The gate literals present in `lowered`: one substring test per distinct literal for all rules."""
        return frozenset(g for g in self._gate_literals if g in lowered)


def _threshold(raw: Any, direction: Direction, what: str) -> float | None:
    value = raw.get(direction.value) if isinstance(raw, Mapping) else raw
    if value is None:
        return None
    if not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise PolicyError(f"{what} must be a number in [0, 1] or null, got {value!r}")
    return float(value)


def _rule(category: str, raw: Any) -> Rule:
    if not isinstance(raw, Mapping) or "regex" not in raw or "name" not in raw:
        raise PolicyError(f"category {category}: each rule needs a name and a regex")
    name = str(raw["name"])
    try:
        pattern = re.compile(str(raw["regex"]), re.IGNORECASE if raw.get("ignore_case", True) else 0)
    except re.error as err:
        raise PolicyError(f"category {category} rule {name}: bad regex: {err}") from None
    score = raw.get("score", 1.0)
    if not isinstance(score, (int, float)) or not 0.0 < float(score) <= 1.0:
        raise PolicyError(f"category {category} rule {name}: score must be in (0, 1]")
    try:
        validator = Validator(raw.get("validator", "none"))
    except ValueError:
        raise PolicyError(f"category {category} rule {name}: unknown validator {raw.get('validator')!r}") from None
    gate = raw.get("gate", [])
    if not isinstance(gate, list) or not all(isinstance(g, str) and g for g in gate):
        raise PolicyError(f"category {category} rule {name}: gate must be a list of non-empty strings")
    return Rule(name, pattern, float(score), validator, tuple(g.lower() for g in gate))


def parse(doc: Mapping[str, Any]) -> Policy:
    """A policy from its JSON form; raises PolicyError naming the bad part."""
    raw_categories = doc.get("categories")
    if not isinstance(raw_categories, Mapping) or not raw_categories:
        raise PolicyError("policy needs a non-empty 'categories' object")
    categories = []
    for name, raw in raw_categories.items():
        if not isinstance(raw, Mapping):
            raise PolicyError(f"category {name} must be an object")
        rules = tuple(_rule(name, r) for r in raw.get("rules", ()))
        model = raw.get("model")
        if not rules and model is None:
            raise PolicyError(f"category {name} has neither rules nor a model")
        on = {d: Thresholds(_threshold(raw.get("flag_at"), d, f"{name}.flag_at"),
                            _threshold(raw.get("block_at"), d, f"{name}.block_at")) for d in Direction}
        categories.append(Category(str(name), rules, None if model is None else str(model),
                                   on[Direction.INPUT], on[Direction.OUTPUT]))
    window = int(doc.get("window_chars", 96))
    context = int(doc.get("context_tokens", 12))
    if window < 16 or context < 0:
        raise PolicyError("window_chars must be >= 16 and context_tokens >= 0")
    return Policy(tuple(categories), float(doc.get("report_at", 0.2)), window, context)


def load(path: str = "") -> Policy:
    """The policy in `path`, or the built-in default when `path` is empty."""
    if path:
        text = Path(path).read_text(encoding="utf-8")
    else:
        text = resources.files("chatmesh.moderation").joinpath("data/default_policy.json").read_text("utf-8")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise PolicyError(f"policy {path or 'default'} is not JSON: {err}") from None
    if not isinstance(doc, dict):
        raise PolicyError("policy must be a JSON object")
    return parse(doc)
