"""Run densa's model directly on one sequence (all positions), for logit comparisons with HF."""

from __future__ import annotations

from pathlib import Path

import torch

from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.model.attention import AttentionMetadata, TorchAttentionBackend, build_group
from densa.model.kv_pages import allocate_kv_caches
from densa.model.loader import load_model


def densa_logits(
    model_dir: Path,
    token_ids: list[int],
    dtype: str = "float32",
    page_size: int = 4,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Logits [T, vocab] for every position of one prompt, through paged KV with shuffled pages;
    in prefill chunks of `chunk_size` tokens (each reading the earlier ones from the pages), or
    all at once."""
    arch = ArchConfig.from_dir(model_dir)
    cpu = torch.device("cpu")
    model = load_model(model_dir, arch, dtype, 512, cpu)
    num_pages = -(-len(token_ids) // page_size)
    caches = allocate_kv_caches(arch, num_pages * 2, page_size, KVFormat.of(dtype), cpu)
    pages = list(range(num_pages * 2 - 1, -1, -2))[:num_pages]  # non-contiguous, descending
    step = chunk_size or len(token_ids)
    logits = []
    for start in range(0, len(token_ids), step):
        end = min(start + step, len(token_ids))
        positions = torch.arange(start, end)
        meta = AttentionMetadata(
            slot_pages=torch.tensor([pages[p // page_size] for p in range(start, end)]),
            slot_offsets=positions % page_size,
            decode=None,
            prefill=build_group(0, [pages], [end], [end - start], page_size, cpu),
        )
        with torch.inference_mode():
            chunk = torch.tensor(token_ids[start:end])
            hidden = model(chunk, positions, caches, meta, TorchAttentionBackend())
            logits.append(model.compute_logits(hidden))  # type: ignore[operator]
    return torch.cat(logits)


def hf_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from densa.model.gguf import ensure_dense_copy

    weights_dir = ensure_dense_copy(model_dir)  # transformers reads a float32 copy of a GGUF
    model = AutoModelForCausalLM.from_pretrained(str(weights_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()
