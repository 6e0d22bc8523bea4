"""The guard-model backend: a model served by Triton Inference Server, reached with tritonclient.

The tensor contract (what chatmesh expects of any guard model it is pointed at):
- input `text`: TYPE_STRING, dims [1], one UTF-8 text per request (batch dimension in front; the model config
  enables Triton's dynamic batching, so concurrent checks from many streams are batched by the server);
- output `scores`: TYPE_FP32, dims [K], the probability per label;
- config parameter `labels`: the K label names, comma-separated, in output order.
A policy category reads a label with `"model": "guard:<label>"`.

A real guard model (for example Llama Guard 3 1B) would sit behind the same tensors as a Python-backend model
that prompts it and turns its "unsafe S1,S10" answer into per-label scores; that adapter, and a GPU to run it on,
are not part of this module. What ships here is the same contract served by the embedded classifier
(`guard_model.py`, labels "profanity"), which `render_repository` writes as a model repository: it proves the
whole path (repository, tritonserver, tritonclient, policy, failure policy) on a CPU, and tests run it on the
real tritonserver started by chatmesh.engine_adapter.triton.launcher.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from chatmesh.mesh.errors import Unavailable

MODEL_NAME = "chatmesh_guard"
MAX_BATCH = 64  # the rendered model's max_batch_size

_CONFIG = """# chatmesh guard model: the embedded classifier behind the guard tensor contract.
name: "{name}"
backend: "python"
default_model_filename: "guard_model.py"
max_batch_size: 64
dynamic_batching {{ max_queue_delay_microseconds: 500 }}
input [ {{ name: "text" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "scores" data_type: TYPE_FP32 dims: [ {k} ] }} ]
parameters {{ key: "labels" value: {{ string_value: "{labels}" }} }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""

_MODEL = '''"""Triton entry point of the chatmesh guard model; the model itself is chatmesh.moderation.guard_model."""

from chatmesh.moderation.guard_model import TritonPythonModel  # noqa: F401
'''


def render_repository(root: Path, name: str = MODEL_NAME) -> Path:
    """Writes a Triton model repository holding the embedded classifier as a guard model (one label,
    "profanity"); returns `root`."""
    labels = ("profanity",)
    folder = root / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(_CONFIG.format(name=name, k=len(labels), labels=",".join(labels)))
    (folder / "1" / "guard_model.py").write_text(_MODEL)
    return root


class TritonGuard:
    """A `TextScorer` backed by a Triton model with the guard contract. Blocking (tritonclient's gRPC client):
    the service runs checks on its worker thread when a guard is configured, under the check deadline."""

    def __init__(self, address: str, model: str = MODEL_NAME, timeout_s: float = 1.0) -> None:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        self._grpcclient = grpcclient
        self._error = InferenceServerException
        self._client = grpcclient.InferenceServerClient(address)
        self._model = model
        self._timeout_s = timeout_s
        try:
            config = self._client.get_model_config(model, as_json=True)["config"]
        except InferenceServerException as err:
            raise Unavailable(f"guard model {model} at {address}: {err.message()}") from None
        raw = config.get("parameters", {}).get("labels", {}).get("string_value", "")
        self.labels: tuple[str, ...] = tuple(label for label in raw.split(",") if label)
        if not self.labels:
            raise Unavailable(f"guard model {model} at {address} declares no 'labels' parameter")

    def score(self, text: str) -> Mapping[str, float]:
        return self.score_many([text])[0]

    def score_many(self, texts: Sequence[str]) -> list[Mapping[str, float]]:
        """One request with a batch of texts (up to the model's max_batch_size per request)."""
        out: list[Mapping[str, float]] = []
        for start in range(0, len(texts), MAX_BATCH):
            part = texts[start:start + MAX_BATCH]
            data = self._grpcclient.InferInput("text", [len(part), 1], "BYTES")
            data.set_data_from_numpy(np.array([[t.encode("utf-8")] for t in part], dtype=np.object_))
            try:
                result = self._client.infer(self._model, [data], client_timeout=self._timeout_s)
            except self._error as err:
                raise Unavailable(f"guard model {self._model}: {err.message()}") from None
            scores = result.as_numpy("scores")
            if scores is None or len(scores) != len(part):
                raise Unavailable(f"guard model {self._model} returned no scores for the batch")
            out.extend(dict(zip(self.labels, (float(s) for s in row))) for row in scores)
        return out

    def close(self) -> None:
        self._client.close()
