"""Each command's help lists its own options, then only the settings its service reads (grouped by module);
`--help-all` lists every setting; positionals parse before or after flags; a reader that leaves early (`| head`)
ends the command quietly."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
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


@pytest.mark.parametrize("command", ["users", "keys", "groups"])
def test_the_account_commands_list_the_database_they_write_to(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Their tables live in the store's database unless CHATMESH_AUTH_DATABASE_URL names another (found by QA:
    the help listed only the gateway's settings, and groups' every service's)."""
    monkeypatch.setenv("COLUMNS", "200")
    text = help_of(command, "--help")
    assert all(flag in text for flag in ("--database-url", "--database-schema", "--auth-database-url", "--data-dir",
                                         "--key-pepper"))
    assert "--moderation-check-thread" not in text and "--summary-threshold-tokens" not in text  # other services
    assert len(text.splitlines()) < 200


F_SETPIPE_SZ = 1031  # Linux fcntl: a pipe's capacity


@pytest.mark.parametrize("argv", [["groups", "--help"], ["config", "table"]])
def test_a_reader_that_leaves_early_ends_the_command_without_a_traceback(argv: list[str]) -> None:
    """`chatmesh groups --help | head`: the pipe made small (4 KiB) so the command is still writing when its
    reader closes; it stops quietly, exit 0 (argparse's help) or 141 (as a command killed by SIGPIPE)."""
    read, write = os.pipe()
    fcntl.fcntl(write, F_SETPIPE_SZ, 4096)
    done = subprocess.Popen([sys.executable, "-m", "chatmesh.mesh.cli", *argv], stdout=write,
                            stderr=subprocess.PIPE, text=True)
    os.close(write)
    try:
        assert os.read(read, 100)
    finally:
        os.close(read)
    _, err = done.communicate(timeout=60)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert done.returncode in (0, 141), (done.returncode, err)
