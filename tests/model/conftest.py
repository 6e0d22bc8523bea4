"""The tokenizer tests need the fetched GGUF; without it they skip and say how to fetch it."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatmesh.mesh.config import Config
from chatmesh.model.assets import GGUF_NAME
from chatmesh.model.settings import MODEL_DIR
from chatmesh.model.tokenizer import Tokenizer, load


@pytest.fixture(scope="session")
def model_dir() -> Path:
    path = Path(Config()[MODEL_DIR])
    if not (path / GGUF_NAME).is_file():
        pytest.skip(f"model file {path / GGUF_NAME} absent; run `chatmesh model fetch`")
    return path


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> Tokenizer:
    return load(model_dir)
