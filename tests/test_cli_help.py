"""Each command's help lists its own options, then only the settings its service reads (grouped by module);
`--help-all` lists every setting; positionals parse before or after flags."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from chatmesh.mesh import config
from chatmesh.mesh.cli import build_parser
from chatmesh.model import assets
from tests.conftest import need_models


def help_of(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        build_parser(argv[0]).parse_args(list(argv))
    assert done.value.code == 0
    return out.getvalue()


def test_model_tokenize_help_fits_a_screen_and_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    text = help_of("model", "tokenize", "--help")
    assert text.startswith("usage: chatmesh model tokenize")
    assert len(text.splitlines()) <= 40, text
    assert "--pieces" in text and "--model VALUE" in text and "model settings" in text
    assert "--gateway-port" not in text and "--database-url" not in text  # other services' settings


def test_help_all_lists_every_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    text = help_of("model", "tokenize", "--help-all")
    assert all(s.flag in text for s in config.all_settings())


def test_serve_lists_its_services_settings_and_no_others(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    text = help_of("serve", "store", "--help")
    assert "store settings" in text and "mesh-wide settings" in text
    assert all(s.flag in text for s in config.settings_of("chatmesh.store.settings"))
    assert not any(s.flag in text for s in config.settings_of("chatmesh.gateway.settings"))
    args = build_parser("serve").parse_args(["serve", "store", "--gateway-port", "1"])  # still accepted
    assert args.service == "store" and args.gateway_port == "1"


def test_a_positional_after_the_flags_parses(tmp_path: Path) -> None:
    need_models(assets.SMOLLM2, assets.LLAMA3_TOKENIZER)
    conversation = tmp_path / "conversation.json"
    conversation.write_text(json.dumps([{"role": "user", "content": "Hi"}]))
    for argv in (["--model", "llama3", str(conversation)], [str(conversation), "--model", "llama3"]):
        out = subprocess.run([sys.executable, "-m", "chatmesh.mesh.cli", "model", "tokenize", *argv],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.splitlines()[0])["model"] == "Llama-3-tokenizer"
