"""The `triton` backend: chatmesh's own Triton model (TensorRT-LLM's LLM API, or the chatmesh engine where
tensorrt_llm is absent) reached over tritonclient's asyncio gRPC streaming.

`build_backend(cfg)` is what GenerateService imports for CHATMESH_ENGINE=triton. With CHATMESH_TRITON_ADDRESS
set it connects to that server; empty, it renders a model repository under the data folder and starts a local
tritonserver (from nvidia-pytriton) with the backend, stopping it on close: `chatmesh up` needs nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatmesh.engine_adapter.backend import Backend
    from chatmesh.mesh.config import Config


def build_backend(cfg: Config) -> Backend:
    from chatmesh.engine_adapter.triton.backend import from_config

    return from_config(cfg)
