"""The model tests need the fetched model files; without them they skip and say how to fetch them."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatmesh.mesh.config import Config
from chatmesh.model import assets, profile
from chatmesh.model.settings import MODEL_DIR
from chatmesh.model.tokenizer import Tokenizer, load


def _fetched(asset: assets.WheelAsset) -> Path:
    path = Path(Config()[MODEL_DIR])
    if not asset.present(path):
        pytest.skip(f"model file {asset.target(path)} absent; run `chatmesh model fetch`")
    return path


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return _fetched(assets.SMOLLM2)


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> Tokenizer:
    return load(model_dir)


@pytest.fixture(scope="session")
def smollm2(model_dir: Path) -> profile.ModelProfile:
    return profile.load_spec("smollm2", model_dir)


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return assets.llama3_tokenizer_dir(_fetched(assets.LLAMA3_TOKENIZER))


@pytest.fixture(scope="session")
def llama3(llama_dir: Path) -> profile.ModelProfile:
    return profile.load_path(str(llama_dir.resolve()))


@pytest.fixture(scope="session")
def llama31_template() -> str:
    """Meta's Llama 3.1 chat_template (the independent oracle of Llama 3.1's format)."""
    return assets.asset_path(assets.LLAMA31_TEMPLATE, _fetched(assets.LLAMA31_TEMPLATE)).read_text()
