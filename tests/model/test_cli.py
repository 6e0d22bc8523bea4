"""`chatmesh model tokenize`: the ids it prints are the profile's rendering of the conversation given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatmesh.mesh.cli import main
from chatmesh.model.profile import ModelProfile
from chatmesh.model.template import Role


def test_tokenize_prints_the_prompt_the_mesh_would_send(llama3: ModelProfile, llama_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"}]
    (tmp_path / "c.json").write_text(json.dumps(conversation))
    model_dir = str(llama_dir.parent)
    assert main(["model", "tokenize", str(tmp_path / "c.json"), "--user", "Bye", "--model", "llama3",
                 "--model-dir", model_dir, "--pieces"]) == 0
    lines = capsys.readouterr().out.splitlines()
    report = json.loads(lines[0])
    want = llama3.render([(Role.SYSTEM, "Be brief."), (Role.USER, "Hi"), (Role.ASSISTANT, "Hello!"),
                          (Role.USER, "Bye")])
    assert report["token_ids"] == list(want.token_ids) and report["prompt_tokens"] == len(want.token_ids)
    assert report["platform_prefix_tokens"] == want.platform_prefix_len
    assert report["model"] == "Llama-3-tokenizer" and report["stop_token_ids"] == [128001, 128008, 128009]
    assert len(lines) == 1 + len(want.token_ids)
    assert '"<|eot_id|>"' in lines[1 + want.platform_prefix_len - 1]  # the prefix ends with the system message


def test_tokenize_says_what_is_wrong(smollm2: ModelProfile, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.json").write_text(json.dumps([{"role": "robot", "content": "x"}]))
    assert main(["model", "tokenize", str(tmp_path / "bad.json")]) == 1
    assert "message 0: wants a role" in capsys.readouterr().err
    assert main(["model", "tokenize", "--user", "x", "--model", str(tmp_path / "missing")]) == 1
    assert "no such file or folder" in capsys.readouterr().err
