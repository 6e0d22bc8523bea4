"""The type checker, not the reader, catches a swapped id: mypy --strict rejects a turn id passed as a
conversation id, and accepts the same call with the right id."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRATCH = """
from chatmesh.mesh.ids import ConversationId, TurnId, parse_conversation_id, parse_turn_id

def load(conversation_id: ConversationId) -> None: ...

turn: TurnId = parse_turn_id("5b0c3f4e-2d1a-4c55-9f0e-8a7d6c5b4a39")
conv: ConversationId = parse_conversation_id("0f1e2d3c-4b5a-4978-8877-665544332211")
load({arg})
"""


def run_mypy(tmp_path: Path, arg: str) -> subprocess.CompletedProcess[str]:
    scratch = tmp_path / "scratch_ids.py"
    scratch.write_text(textwrap.dedent(SCRATCH.format(arg=arg)))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--config-file", str(ROOT / "pyproject.toml"),
         str(scratch)], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_swapped_id_is_rejected_by_mypy(tmp_path: Path) -> None:
    wrong = run_mypy(tmp_path, "turn")
    assert wrong.returncode == 1, wrong.stdout
    assert 'incompatible type "TurnId"; expected "ConversationId"' in wrong.stdout
    right = run_mypy(tmp_path, "conv")
    assert right.returncode == 0, right.stdout
