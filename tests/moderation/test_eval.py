"""The evaluation set and `chatmesh moderation eval`.

Stated thresholds for the built-in policy on the built-in set (225 examples): every category precision >= 0.85
and recall >= 0.90; no benign example flagged or blocked; at least 95% of violating examples stopped. The set
was written alongside the policy, so these numbers are an optimistic regression bar, not a field estimate.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatmesh.mesh.cli import main
from chatmesh.moderation.classifier import profanity_model
from chatmesh.moderation.evaluation import Kind, evaluate, load_examples
from chatmesh.moderation.moderator import Moderator
from chatmesh.moderation.policy import load

MIN_PRECISION, MIN_RECALL, MIN_VIOLATING_STOPPED = 0.85, 0.90, 0.95


def test_the_set_is_big_enough_and_mixed() -> None:
    examples = load_examples()
    assert len(examples) >= 200
    kinds = {k: sum(1 for e in examples if e.kind is k) for k in Kind}
    assert all(n >= 30 for n in kinds.values()), kinds
    assert sum(1 for e in examples if len(e.chunks) > 1) >= 50  # split across chunks
    assert len({e.id for e in examples}) == len(examples)


def test_the_policy_meets_the_stated_thresholds() -> None:
    report = evaluate(Moderator(load(), profanity_model()), load_examples())
    for r in report.categories:
        assert r.support > 0, r.category
        assert r.precision is not None and r.precision >= MIN_PRECISION, r
        assert r.recall is not None and r.recall >= MIN_RECALL, r
    kinds = {k.kind: k for k in report.kinds}
    assert kinds[Kind.BENIGN].stopped == 0
    assert kinds[Kind.VIOLATING].stopped >= MIN_VIOLATING_STOPPED * kinds[Kind.VIOLATING].examples


def test_eval_command_prints_precision_and_recall(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["moderation", "eval", "--min-precision", str(MIN_PRECISION), "--min-recall", str(MIN_RECALL)]) == 0
    out = capsys.readouterr().out
    assert "precision" in out and "recall" in out
    assert all(name in out for name in ("profanity", "insult", "credentials", "payment_card"))


def test_eval_command_fails_below_its_bounds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "set.jsonl"
    rows = [{"id": "a", "kind": "violating", "direction": "input", "text": "my cat is called Biscuit",
             "labels": ["payment_card"]},
            {"id": "b", "kind": "violating", "direction": "output", "chunks": ["card 4111 1111 ", "1111 1111"],
             "labels": ["payment_card"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert main(["moderation", "eval", "--set", str(path), "--min-recall", "0.9"]) == 1
    assert "payment_card recall=0.500" in capsys.readouterr().out
