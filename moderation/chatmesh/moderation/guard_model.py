"""The Triton Python-backend model behind the guard contract (guard.py), scoring with the embedded classifier.

Runs inside Triton's Python stub (which provides `triton_python_backend_utils`); never imported by the service.
Each request carries one text; Triton's dynamic batcher hands several requests to one `execute`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

from chatmesh.moderation.classifier import profanity_model


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        self._model = profanity_model()

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "text").as_numpy().reshape(-1)
            scores = np.array([[self._model.score(t.decode("utf-8") if isinstance(t, bytes) else str(t))]
                               for t in texts], dtype=np.float32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("scores", scores)]))
        return responses
