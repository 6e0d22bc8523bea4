"""Settings of the `triton` backend (CHATMESH_ENGINE=triton)."""

from __future__ import annotations

from chatmesh.mesh.config import Setting

TRITON_ADDRESS = Setting("CHATMESH_TRITON_ADDRESS", "",
                         "gRPC host:port of Triton Inference Server; empty: start a local tritonserver (nvidia-pytriton)",
                         str)
TRITON_MODEL = Setting("CHATMESH_TRITON_MODEL", "chatmesh_llm", "name of chatmesh's model in the Triton repository", str)
TRITON_TIMEOUT_S = Setting("CHATMESH_TRITON_TIMEOUT_S", 600.0,
                           "deadline of one generation's Triton stream, seconds", float)
TRITON_RETRIES = Setting("CHATMESH_TRITON_RETRIES", 2,
                         "retries of a generation Triton answered UNAVAILABLE before its first event", int)
TRITON_STATS_INTERVAL_MS = Setting("CHATMESH_TRITON_STATS_INTERVAL_MS", 1000,
                                   "how often the engine's statistics and readiness are read from Triton (ms)", int)
TRITON_ENGINE = Setting("CHATMESH_TRITON_ENGINE", "auto",
                        "engine inside a locally started Triton: auto (TensorRT-LLM if it imports, else sim), "
                        "trtllm, sim, local", str, choices=("auto", "trtllm", "sim", "local"))
TRITON_TLS = Setting("CHATMESH_TRITON_TLS", "auto",
                     "mutual TLS to Triton with the engine's mesh certificate: auto (whenever the mesh runs mutual "
                     "TLS, except to a CHATMESH_TRITON_ADDRESS on loopback, a sidecar), on, off (loopback only)",
                     str, choices=("auto", "on", "off"))
TRITON_REPOSITORY = Setting("CHATMESH_TRITON_REPOSITORY", "",
                            "model repository for a locally started Triton; empty: render one under the data folder",
                            str)
