"""A token embedding kept in its GGUF blocks: rows are dequantized when looked up.

Why: an embedding is read a row per token, never streamed whole, so it needs no kernel format:
the file's own blocks (Q4_K, Q6_K, Q8_0, ...) are the most compact form and a lookup decodes
only the rows it needs. On Qwen2.5-Coder-1.5B (vocabulary 151,936 x 1,536) this keeps 131 MB
of Q4_K instead of 933 MB of float32. Rows decode exactly as the `gguf` package dequantizes
them (densa.quant.gguf_blocks where it maps the type, else the package itself).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from densa.quant import gguf_blocks


class GGUFEmbedding(nn.Module):
    """nn.Embedding's lookup over quantized rows ([num_embeddings, row bytes] of blocks)."""

    def __init__(self, type_name: str, num_embeddings: int, embedding_dim: int, row_bytes: int):
        super().__init__()
        self.type_name = type_name
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.blocks: torch.Tensor
        blocks = torch.empty(num_embeddings, row_bytes, dtype=torch.uint8)
        self.register_buffer("blocks", blocks, persistent=False)

    @classmethod
    def row_bytes(cls, type_name: str, embedding_dim: int) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block_len, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        return embedding_dim // block_len * block_bytes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).cpu().numpy()
        rows = np.asarray(self.blocks.numpy()[ids])  # a gather: [tokens, row bytes]
        values = torch.from_numpy(self.dequantize_rows(rows))
        return values.view(*input_ids.shape, self.embedding_dim)

    def dequantize_rows(self, rows: np.ndarray) -> np.ndarray:
        """float32 [len(rows), embedding_dim] for raw block rows of this table."""
        block_type = gguf_blocks.BLOCK_TYPES.get(self.type_name)
        if block_type is not None:
            family = next(iter(block_type.decoders))
            groups = gguf_blocks.decode(rows, self.type_name, family, self.embedding_dim)
            return np.ascontiguousarray(groups.dequantize(), dtype=np.float32)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(rows, GGMLQuantizationType[self.type_name])
        return np.ascontiguousarray(values, dtype=np.float32).reshape(-1, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, blocks={self.type_name}"
