"""A decoupled Python-backend model that streams each input token back: proves the launcher and the stub."""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]


class TritonPythonModel:
    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            tokens = pb_utils.get_input_tensor_by_name(request, "token_ids").as_numpy()
            for token in tokens:
                out = pb_utils.Tensor("token_id", np.array([token], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
