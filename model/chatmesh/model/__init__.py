"""The chat model's assets shared by chat and engine: the GGUF file, its tokenizer and chat template."""
