"""The `local` backend tests load the real SmolLM2 GGUF once per session (`need_models`: without the file a skip
that says how to fetch it, a failure in CI). One torch thread: the machine's cores are shared."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chatmesh.model.assets import SMOLLM2, gguf_path
from tests.conftest import need_models

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def gguf_file() -> Path:
    return gguf_path(need_models(SMOLLM2))


@pytest.fixture(scope="session")
def loaded(gguf_file: Path) -> object:
    from chatmesh.engine_adapter.local.model import load_gguf

    return load_gguf(gguf_file)
