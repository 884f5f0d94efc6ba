"""L4: model families, layers, weight loading (HF directories and GGUF files), tokenizers, attention."""
