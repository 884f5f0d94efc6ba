"""Calibrating static FP8 KV scales: run real text through the model, record each layer's K and
V absolute maxima, and turn them into per-layer scales (`KVScales.from_amax`).

The pass runs the engine's own paged path (teacher-forced scoring, chunk by chunk), so K and V are
observed exactly as they will be stored. Calibrate with a high-precision KV cache: the values seen
at layer i then do not depend on how earlier layers' caches were quantized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from densa.engine.llm_engine import LLMEngine
from densa.formats.fp8_kv import KVScales
from densa.model.attention import AttentionBackend, AttentionGroup, AttentionMetadata, LayerKVCache
from densa.offline.scoring import iter_logits


class AmaxObserver:
    """An attention backend wrapper that records max |K| and max |V| per layer as they are stored;
    attention itself is delegated unchanged."""

    def __init__(self, inner: AttentionBackend, kv_caches: Sequence[LayerKVCache]) -> None:
        self.inner = inner
        self.name = f"{inner.name}+amax"
        self.capabilities = inner.capabilities
        self._layer_of = {id(cache): i for i, cache in enumerate(kv_caches)}
        self.k_amax = [0.0] * len(kv_caches)
        self.v_amax = [0.0] * len(kv_caches)
        self.num_tokens = 0  # tokens seen by layer 0

    def store_kv(
        self, cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        layer = self._layer_of[id(cache)]
        self.k_amax[layer] = max(self.k_amax[layer], _finite_amax(k))
        self.v_amax[layer] = max(self.v_amax[layer], _finite_amax(v))
        if layer == 0:
            self.num_tokens += k.shape[0]
        self.inner.store_kv(cache, k, v, meta)

    def attend(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        group: AttentionGroup,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return self.inner.attend(q, cache, group, scale, new_kv)


def _finite_amax(x: torch.Tensor) -> float:
    """max |x| over finite entries (a stray inf must not turn every scale into inf)."""
    values = x.detach().float().abs()
    return float(values[torch.isfinite(values)].max()) if values.numel() else 0.0


def calibrate_kv_scales(
    engine: LLMEngine,
    texts: Sequence[list[int]],
    description: str,
    on_text: Callable[[int], None] | None = None,
) -> KVScales:
    """Per-layer static scales from the K/V the model produces over `texts` (token id lists).

    `on_text(num_tokens)` is called after each text (progress). The engine must be idle; its
    attention backend is restored afterwards even if a text fails.
    """
    runner = engine.runner
    caches = [c for c in runner.kv_caches if isinstance(c, LayerKVCache)]
    if len(caches) != len(runner.kv_caches):
        raise ValueError(
            "static scales are calibrated for K/V pages; this model caches MLA latents, "
            "whose FP8 pages use dynamic scales (--kv-scales dynamic)"
        )
    observer = AmaxObserver(runner.backend, caches)
    runner.backend = observer
    # The fused C++ step stores K/V itself, past the backend: the eager layers must run here.
    fused = runner.model.fused_decode
    was_fused = fused is not None and fused.enabled
    if fused is not None:
        fused.enable(False)
    try:
        for token_ids in texts:
            for _ in iter_logits(engine, token_ids):
                pass
            if on_text is not None:
                on_text(len(token_ids))
    finally:
        runner.backend = observer.inner
        if fused is not None:
            fused.enable(was_fused)
    info = {
        "model": engine.config.model.served_model_name,
        "kv_cache_dtype_observed": engine.config.cache.kv_cache_dtype,
        "num_texts": len(texts),
        "num_tokens": observer.num_tokens,
        "text": description,
    }
    return KVScales.from_amax(observer.k_amax, observer.v_amax, info)
