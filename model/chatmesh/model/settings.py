"""Where the model file lives."""

from __future__ import annotations

import os

from chatmesh.mesh.config import Setting

MODEL_DIR = Setting("CHATMESH_MODEL_DIR", "~/.cache/chatmesh/models",
                    "folder holding the fetched model file (SmolLM2-135M-Instruct GGUF)", os.path.expanduser)
