"""The model tests need the fetched model files (`need_models`: a skip that says how to fetch them, a failure in
CI)."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatmesh.model import assets, profile
from chatmesh.model.tokenizer import Tokenizer, load
from tests.conftest import need_models


def _fetched(asset: assets.WheelAsset) -> Path:
    return need_models(asset)


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
