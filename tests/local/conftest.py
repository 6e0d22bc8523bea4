"""The `local` backend tests load the real SmolLM2 GGUF once per session; without the file they skip and say
how to fetch it. One torch thread: the machine's cores are shared."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chatmesh.mesh.config import Config
from chatmesh.model.assets import GGUF_NAME
from chatmesh.model.settings import MODEL_DIR

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def gguf_file() -> Path:
    path = Path(Config()[MODEL_DIR]) / GGUF_NAME
    if not path.is_file():
        pytest.skip(f"model file {path} absent; run `chatmesh model fetch`")
    return path


@pytest.fixture(scope="session")
def loaded(gguf_file: Path) -> object:
    from chatmesh.engine_adapter.local.model import load_gguf

    return load_gguf(gguf_file)
