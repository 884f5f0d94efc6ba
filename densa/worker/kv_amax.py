"""Watching the K and V a runner stores (KV calibration): an attention backend wrapper that
records each layer's max |K| and max |V| as they are stored, attention itself delegated
unchanged. ModelRunner.observing_kv installs it; offline/kv_calibration.py reads it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from densa.model.attention import AttentionBackend, AttentionGroup, AttentionMetadata, LayerKVCache
from densa.model.interface import CausalLM
from densa.model.kv_layout import LayerCache


class Observed(Protocol):
    """What observing K and V changes of a runner (ModelRunner has it): its attention backend,
    while inside, and whether its model's fused step runs."""

    backend: AttentionBackend
    model: CausalLM
    kv_caches: list[LayerCache]


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


@contextlib.contextmanager
def observing_kv(runner: Observed) -> Iterator[AmaxObserver]:
    """The runner's K and V observed while inside: the eager layers run meanwhile, since the
    fused C++ step stores K/V past the attention backend. Raises ValueError for pages that are
    not K and V (MLA latents, whose FP8 pages use dynamic scales)."""
    caches = [c for c in runner.kv_caches if isinstance(c, LayerKVCache)]
    if len(caches) != len(runner.kv_caches):
        raise ValueError(
            "static scales are calibrated for K/V pages; this model caches MLA latents, "
            "whose FP8 pages use dynamic scales (--kv-scales dynamic)"
        )
    observer = AmaxObserver(runner.backend, caches)
    runner.backend = observer
    fused = runner.model.fused_decode
    was_fused = fused is not None and fused.enabled
    if fused is not None:
        fused.enable(False)
    try:
        yield observer
    finally:
        runner.backend = observer.inner
        if fused is not None:
            fused.enable(was_fused)
