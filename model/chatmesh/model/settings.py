"""Which model the mesh serves, and where fetched model files live."""

from __future__ import annotations

import os

from chatmesh.mesh.config import Setting

MODEL_DIR = Setting("CHATMESH_MODEL_DIR", "~/.cache/chatmesh/models",
                    "folder holding the fetched model files (SmolLM2-135M-Instruct GGUF, Llama 3 tokenizer)",
                    os.path.expanduser)
MODEL = Setting("CHATMESH_MODEL", "smollm2",
                "the served model's profile (tokenizer, chat template, stop tokens, context), the same on chat and "
                "every engine: smollm2 (the fetched SmolLM2-135M-Instruct GGUF), llama3 (the fetched Llama 3 "
                "tokenizer), a .gguf file, or a Hugging Face model folder with tokenizer.json", str)
