"""The `triton` backend: chatmesh's own Triton model (TensorRT-LLM's LLM API, or the chatmesh engine core where
tensorrt_llm is absent) reached over tritonclient's asyncio gRPC streaming."""
