"""chatmesh's Triton model `chatmesh_llm`: the shim Triton's Python backend loads.

The model itself is chatmesh.engine_adapter.triton.python_model (typed, tested, importable anywhere); this file
only hands it Triton's `triton_python_backend_utils`, which exists inside the backend stub alone. The Python that
runs the stub must have chatmesh installed (`pip install chatmesh` in the Triton image; docs/triton.md).
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

from chatmesh.engine_adapter.triton.python_model import ChatmeshModel


class TritonPythonModel(ChatmeshModel):
    def __init__(self) -> None:
        super().__init__(pb_utils)
