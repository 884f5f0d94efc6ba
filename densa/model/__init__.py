"""L4: model families, layers, weight loading (HF directories, GGUF), tokenizers, attention."""
