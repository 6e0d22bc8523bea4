"""Moderation's pure core: text in, a Verdict out, by the policy's rules and the embedded classifier.

`Moderator.check_input` judges one whole user message. `Moderator.open_output()` returns an `OutputCheck` for
one streamed reply, which judges each chunk through a sliding `Window` (see window.py for what is new in a
chunk). `validate` enforces the size limits; it is called by the servicer before any check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import functools
from dataclasses import dataclass
from typing import Protocol

from chatmesh.mesh.errors import InvalidArgument
from chatmesh.moderation.classifier import ProfanityModel, tokens
from chatmesh.moderation.policy import Action, Category, Direction, Policy, validate
from chatmesh.moderation.window import View, Window


@dataclass(frozen=True)
class CategoryScore:
    """A category's score in [0, 1] and what produced it (a rule name or a model name)."""

    category: str
    score: float
    source: str


@dataclass(frozen=True)
class Verdict:
    """A decision. `reason` is for logs and the turn's outcome; it never contains the checked text.
    `fallback` is True when the check did not finish and a failure policy chose the action."""

    action: Action
    categories: tuple[CategoryScore, ...]
    reason: str
    fallback: bool = False

    @staticmethod
    def failed(action: Action, why: str) -> Verdict:
        return Verdict(action, (), why, fallback=True)


ALLOW = Verdict(Action.ALLOW, (), "")


# Time limits scale with the text: the embedded check runs ~0.4 ms per KB here (390 ms for 1 MB), so a pasted
# document (the message size policy allows 1 MiB) gets the configured deadline per 32 KiB instead of failing
# over its policy for being long.
SCALE_BYTES = 32 * 1024


def scaled(seconds: float, text_bytes: int) -> float:
    """The time limit for checking a text of `text_bytes`: `seconds` per 32 KiB, never less than `seconds`."""
    return seconds * max(1.0, text_bytes / SCALE_BYTES)


def validate_text(text: str, max_bytes: int, what: str, allow_empty: bool = False) -> None:
    """Raises InvalidArgument for empty (unless allowed) or oversized text."""
    if not text and not allow_empty:
        raise InvalidArgument(f"{what} is empty")
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > max_bytes:
        raise InvalidArgument(f"{what} is {size} bytes, over the limit of {max_bytes}")


def decide(policy: Policy, direction: Direction, scores: Mapping[str, CategoryScore]) -> Verdict:
    """Turns category scores into a verdict: the most severe action over categories, reported highest first."""
    action = Action.ALLOW
    worst: list[str] = []
    reported: list[CategoryScore] = []
    for category in policy.categories:
        cs = scores.get(category.name)
        if cs is None:
            continue
        cat_action = category.thresholds(direction).action(cs.score)
        if cs.score >= policy.report_at or cat_action > Action.ALLOW:
            reported.append(cs)
        if cat_action > action:
            action, worst = cat_action, []
        if cat_action == action and action > Action.ALLOW:
            worst.append(f"{cs.category} {cs.score:.2f} ({cs.source})")
    reported.sort(key=lambda c: -c.score)
    reason = "" if action is Action.ALLOW else f"{action.name.lower()}: {', '.join(worst)}"
    return Verdict(action, tuple(reported), reason)


class TextScorer(Protocol):
    """A model that scores a whole text per label, such as a guard model served elsewhere (see guard.py).
    It may block (the service then runs checks on its worker thread) and may raise; the failure policy answers."""

    labels: tuple[str, ...]

    def score(self, text: str) -> Mapping[str, float]: ...

    def score_many(self, texts: Sequence[str]) -> list[Mapping[str, float]]:
        """Scores of several texts in one call (one batched request to a served model)."""
        ...


GUARD_PREFIX = "guard:"


class Moderator:
    """Judges text by `policy`. Score sources for categories with a model: "profanity" is `model` (the embedded
    classifier, on words: see window.py for which), "guard:<label>" is `guard`'s score for that label, on the
    whole text (input) or the window (output: tail + chunk, so a guard sees a split phrase whole)."""

    def __init__(self, policy: Policy, model: ProfanityModel, guard: TextScorer | None = None) -> None:
        guard_labels = {GUARD_PREFIX + label for label in guard.labels} if guard is not None else set()
        unknown = policy.models - {"profanity"} - guard_labels
        if unknown:
            raise InvalidArgument(f"policy names models this backend does not have: {sorted(unknown)}")
        self.policy = policy
        self.model = model
        self.guard = guard
        self._quiet_below = {d: min([policy.report_at, *(t for c in policy.categories
                                                         for t in (c.thresholds(d).flag_at, c.thresholds(d).block_at)
                                                         if t is not None)]) for d in Direction}

    def check_input(self, text: str) -> Verdict:
        return self._judge(Direction.INPUT, View(text, 0), tokens(text))

    def open_output(self) -> OutputCheck:
        return OutputCheck(self)

    def _score(self, category: Category, view: View, present: frozenset[str], words: Sequence[str],
               guard_scores: Callable[[], Mapping[str, float]]) -> CategoryScore | None:
        best: CategoryScore | None = None
        for rule in category.rules:
            if (best is not None and best.score >= rule.score) or (rule.gate and present.isdisjoint(rule.gate)):
                continue
            for m in rule.pattern.finditer(view.text):
                if view.is_new(m.end()) and validate(rule.validator, m.group()):
                    best = CategoryScore(category.name, rule.score, rule.name)
                    break
        p: float | None = None
        if category.model is None:
            pass
        elif category.model.startswith(GUARD_PREFIX):
            p = guard_scores().get(category.model.removeprefix(GUARD_PREFIX), 0.0)
        elif words:
            p = self.model.score_tokens(words)
        if p is not None and (best is None or p > best.score):
            best = CategoryScore(category.name, p, category.model or "")
        return best

    @functools.cached_property
    def uses_guard(self) -> bool:
        return any(m.startswith(GUARD_PREFIX) for m in self.policy.models)

    def check_outputs(self, chunks: Sequence[tuple[OutputCheck, str]]) -> list[Verdict]:
        """Judges the next chunk of several replies at once: one batched guard call for all of them."""
        views = [check.advance(text) for check, text in chunks]
        if not (self.uses_guard and self.guard is not None):
            return [self._judge(Direction.OUTPUT, view, view.words) for view in views]
        scores = self.guard.score_many([view.text for view in views])
        return [self._judge(Direction.OUTPUT, view, view.words, guard) for view, guard in zip(views, scores)]

    def _judge(self, direction: Direction, view: View, words: Sequence[str],
               prefetched: Mapping[str, float] | None = None) -> Verdict:
        present = self.policy.gates_in(view.text.lower())
        cache: list[Mapping[str, float]] = [] if prefetched is None else [prefetched]

        def guard_scores() -> Mapping[str, float]:
            if not cache:
                cache.append(self.guard.score(view.text) if self.guard is not None else {})
            return cache[0]

        scores = {c.name: s for c in self.policy.categories
                  if (s := self._score(c, view, present, words, guard_scores)) is not None}
        if all(cs.score < self._quiet_below[direction] for cs in scores.values()):
            return ALLOW  # nothing reaches a report or flag threshold: the common case, without the bookkeeping
        return decide(self.policy, direction, scores)


class OutputCheck:
    """The check of one streamed reply: `check(chunk)` judges each chunk in order (mutable, one per stream)."""

    def __init__(self, moderator: Moderator) -> None:
        self._moderator = moderator
        policy, model = moderator.policy, moderator.model
        self._window = Window(policy.window_chars, policy.context_tokens,
                              keep_as_context=lambda word: not model.leans_profane(word))
        self.chunks = 0

    @property
    def checked_chars(self) -> int:
        return self._window.checked_chars

    def skip(self, chunk: str) -> None:
        """Slides the window over a chunk that will not be judged (its check was shed past its deadline)."""
        self.advance(chunk)

    def advance(self, chunk: str) -> View:
        """Slides the window over the next chunk and returns what to judge (see `Moderator.check_outputs`)."""
        self.chunks += 1
        return self._window.push(chunk)

    def check(self, chunk: str) -> Verdict:
        view = self.advance(chunk)
        return self._moderator._judge(Direction.OUTPUT, view, view.words)
