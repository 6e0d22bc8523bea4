"""The evaluation set and its scoring: precision and recall per category, and how often each kind of text
(benign, borderline, violating) is let through.

The set (`data/eval.jsonl`, written for chatmesh) holds one example a line: an id, a kind, a direction
(input: one user message; output: a reply given as `chunks`, often cut mid-word or mid-number to exercise the
sliding window), and `labels`, the categories a careful reviewer assigns. Category meanings: profanity =
vulgar or offensive words (insulting words count, self-directed or not; a place name such as Hell's Kitchen
does not); insult = abuse directed at a person; credentials = a real-looking secret (key, token, private key,
password value); payment_card = a valid card number; personal_id = a national id number; prompt_injection =
an attempt to override the assistant's instructions (input only).

A category is predicted for an example when, in any of its verdicts, the category reaches its flag threshold
for that direction. Examples labelled with a category count as positives for it; everything else is negative.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from chatmesh.mesh.errors import InvalidArgument
from chatmesh.moderation.moderator import Moderator, Verdict
from chatmesh.moderation.policy import Action, Direction


class Kind(enum.Enum):
    """How the example is meant: plainly fine, fine but tricky, or in violation."""

    BENIGN = "benign"
    BORDERLINE = "borderline"
    VIOLATING = "violating"


@dataclass(frozen=True)
class Example:
    id: str
    kind: Kind
    direction: Direction
    chunks: tuple[str, ...]
    labels: frozenset[str]


@dataclass(frozen=True)
class Prediction:
    example: Example
    categories: frozenset[str]
    action: Action


@dataclass(frozen=True)
class CategoryResult:
    category: str
    tp: int
    fp: int
    fn: int

    @property
    def support(self) -> int:
        return self.tp + self.fn

    @property
    def precision(self) -> float | None:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else None

    @property
    def recall(self) -> float | None:
        return self.tp / self.support if self.support else None


@dataclass(frozen=True)
class KindResult:
    kind: Kind
    examples: int
    stopped: int  # flagged or blocked
    blocked: int


@dataclass(frozen=True)
class Report:
    categories: tuple[CategoryResult, ...]
    kinds: tuple[KindResult, ...]
    wrong: tuple[str, ...]  # ids of examples whose predicted categories differ from their labels


def load_examples(path: str = "") -> list[Example]:
    """The examples in `path`, or the built-in set."""
    if path:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    else:
        lines = resources.files("chatmesh.moderation").joinpath("data/eval.jsonl").read_text("utf-8").splitlines()
    examples = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            chunks = tuple(raw["chunks"]) if "chunks" in raw else (raw["text"],)
            examples.append(Example(str(raw["id"]), Kind(raw["kind"]), Direction(raw["direction"]), chunks,
                                    frozenset(raw.get("labels", ()))))
        except (KeyError, ValueError, TypeError) as err:
            raise InvalidArgument(f"evaluation set line {n}: {err}") from None
    return examples


def predict(moderator: Moderator, example: Example) -> Prediction:
    verdicts: list[Verdict]
    match example.direction:
        case Direction.INPUT:
            verdicts = [moderator.check_input("".join(example.chunks))]
        case Direction.OUTPUT:
            check = moderator.open_output()
            verdicts = [check.check(chunk) for chunk in example.chunks]
    thresholds = {c.name: c.thresholds(example.direction) for c in moderator.policy.categories}
    flagged = frozenset(cs.category for v in verdicts for cs in v.categories
                        if thresholds[cs.category].action(cs.score) >= Action.FLAG)
    return Prediction(example, flagged, max(v.action for v in verdicts))


def score(predictions: Sequence[Prediction], categories: Iterable[str]) -> Report:
    results = []
    for name in categories:
        tp = sum(1 for p in predictions if name in p.categories and name in p.example.labels)
        fp = sum(1 for p in predictions if name in p.categories and name not in p.example.labels)
        fn = sum(1 for p in predictions if name not in p.categories and name in p.example.labels)
        results.append(CategoryResult(name, tp, fp, fn))
    kinds = tuple(KindResult(kind, sum(1 for p in predictions if p.example.kind is kind),
                             sum(1 for p in predictions if p.example.kind is kind and p.action >= Action.FLAG),
                             sum(1 for p in predictions if p.example.kind is kind and p.action is Action.BLOCK))
                  for kind in Kind)
    wrong = tuple(p.example.id for p in predictions if p.categories != p.example.labels)
    return Report(tuple(results), kinds, wrong)


def evaluate(moderator: Moderator, examples: Sequence[Example]) -> Report:
    return score([predict(moderator, e) for e in examples], [c.name for c in moderator.policy.categories])


def _pct(value: float | None) -> str:
    return "    -" if value is None else f"{value:5.3f}"


def render(report: Report) -> str:
    lines = [f"{'category':<18} {'support':>7} {'tp':>4} {'fp':>4} {'fn':>4} {'precision':>9} {'recall':>7}"]
    for r in report.categories:
        lines.append(f"{r.category:<18} {r.support:>7} {r.tp:>4} {r.fp:>4} {r.fn:>4} "
                     f"{_pct(r.precision):>9} {_pct(r.recall):>7}")
    lines.append("")
    lines.append(f"{'kind':<18} {'examples':>8} {'flagged or blocked':>19} {'blocked':>8}")
    for k in report.kinds:
        lines.append(f"{k.kind.value:<18} {k.examples:>8} {k.stopped:>19} {k.blocked:>8}")
    if report.wrong:
        lines.append("")
        lines.append(f"examples whose categories differ from their labels ({len(report.wrong)}): "
                     + ", ".join(report.wrong))
    return "\n".join(lines)
