"""`chatmesh moderation eval`: precision and recall per category on the evaluation set, under the configured
policy (CHATMESH_MODERATION_POLICY_FILE); exits 1 when a category falls below --min-precision/--min-recall."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from chatmesh.mesh import config
from chatmesh.mesh.config import Config
from chatmesh.moderation import settings
from chatmesh.moderation.classifier import profanity_model
from chatmesh.moderation.evaluation import Report, evaluate, load_examples, render
from chatmesh.moderation.guard import render_repository
from chatmesh.moderation.moderator import Moderator
from chatmesh.moderation.policy import load


def register(sub: Any) -> None:
    p = sub.add_parser("moderation", help="moderation: evaluate the policy on the labelled evaluation set")
    p.add_argument("action", choices=("eval", "guard-repository"),
                   help="eval: precision/recall on the evaluation set; guard-repository: write a Triton model "
                        "repository serving the embedded classifier under the guard contract to --out")
    p.add_argument("--out", default="", metavar="DIR", help="folder for guard-repository")
    p.add_argument("--set", dest="eval_set", default="", metavar="PATH",
                   help="evaluation set (JSON lines); default: the built-in set of the package")
    p.add_argument("--min-precision", type=float, default=0.0, help="fail when a category's precision is lower")
    p.add_argument("--min-recall", type=float, default=0.0, help="fail when a category's recall is lower")
    config.add_flags(p, *config.SERVICE_SETTINGS["moderation"])
    p.set_defaults(handler=_moderation)


def below(report: Report, min_precision: float, min_recall: float) -> list[str]:
    """Categories (with labelled examples) under either bound, as 'name precision=x' lines."""
    out = []
    for r in report.categories:
        if r.precision is not None and r.precision < min_precision:
            out.append(f"{r.category} precision={r.precision:.3f} < {min_precision}")
        if r.recall is not None and r.recall < min_recall:
            out.append(f"{r.category} recall={r.recall:.3f} < {min_recall}")
    return out


def _moderation(args: argparse.Namespace) -> int:
    cfg = Config(flags=config.flags_of(args))
    if args.action == "guard-repository":
        if not args.out:
            print("chatmesh moderation guard-repository needs --out DIR")
            return 2
        print(render_repository(Path(args.out)))
        return 0
    moderator = Moderator(load(cfg[settings.POLICY_FILE]), profanity_model())
    examples = load_examples(args.eval_set)
    report = evaluate(moderator, examples)
    print(f"{len(examples)} examples, policy {cfg[settings.POLICY_FILE] or 'built-in default'}\n")
    print(render(report))
    failing = below(report, args.min_precision, args.min_recall)
    for line in failing:
        print(f"BELOW THRESHOLD: {line}")
    return 1 if failing else 0
