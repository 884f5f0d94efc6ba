"""Calibrating static FP8 KV scales: run real text through the model, record each layer's K and
V absolute maxima, and turn them into per-layer scales (`KVScales.from_amax`).

The pass runs the engine's own paged path (teacher-forced scoring, chunk by chunk), so K and V are
observed exactly as they will be stored. Calibrate with a high-precision KV cache: the values seen
at layer i then do not depend on how earlier layers' caches were quantized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from densa.engine.llm_engine import LLMEngine
from densa.formats.fp8_kv import KVScales
from densa.offline.scoring import iter_logits


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
    with engine.runner.observing_kv() as observer:
        for token_ids in texts:
            for _ in iter_logits(engine, token_ids):
                pass
            if on_text is not None:
                on_text(len(token_ids))
    info = {
        "model": engine.config.model.served_model_name,
        "kv_cache_dtype_observed": engine.config.cache.kv_cache_dtype,
        "num_texts": len(texts),
        "num_tokens": observer.num_tokens,
        "text": description,
    }
    return KVScales.from_amax(observer.k_amax, observer.v_amax, info)
