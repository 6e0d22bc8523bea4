"""The README opens with the two commands, and its settings table is the one the code declares."""

from __future__ import annotations

from pathlib import Path

from chatmesh.mesh.commands import readme_with_table

ROOT = Path(__file__).resolve().parents[1]


def test_readme_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1:lines.index("```bash") + 3]
    assert block[0].startswith("./dev up")
    assert block[1].startswith("./dev test")
    assert "./dev test" in (ROOT / ".ci" / "run").read_text()


def test_settings_table_is_current() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme == readme_with_table(readme), "run `chatmesh config readme` to refresh the README's table"
