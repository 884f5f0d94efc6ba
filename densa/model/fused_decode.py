"""The fused decode step: a decode-only batch through every layer in one C++ call; other steps
(prefill chunks, mixed) run each layer as two C++ calls around the attention backend.

Why: at batch 1 a step of the eager model is ~450 small torch ops (30 layers x norms, projections,
RoPE, stores, attention, activations), and their dispatch, not arithmetic, was most of the step
(docs/benchmarks/peers/). densa/kernels/cpu/csrc/decoder.cpp runs the same computation without
returning to Python between layers, reading the same weights and writing the same KV pages.

Prefill chunks are compute-bound, so dispatch matters less there, but the eager layer's ~20
elementwise ops (norms, RoPE's muls and cat, stores, SiLU, residual adds) were ~25% of prefill
time; in C++ they are a few passes over the rows.

What it takes: float32 compute, dense float32 or packed (w4a8 / w5a8 / w5ma8 / w6a8 / w6ma8 /
w8a8 / w8, or shards of those side by side) projections, a float32, bfloat16, fp8 or int8 KV
cache, and a step with no prefill rows. Anything else runs the eager model;
`unsupported_reason` says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from densa.kernels.cpu import native
from densa.model.attention import AttentionBackend, AttentionMetadata, LayerKVCache, attend_stored
from densa.model.linear import Linear
from densa.model.packed_linear import PackedLinear, ShardedPackedLinear

_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8)

# How the C++ decoder reads a projection (csrc/module.cpp): (bits, tensor, bias, out, in), or
# for a sharded one ([(bits, tensor, out) per shard], bias, out, in).
ShardSpec = tuple[int, torch.Tensor, int]
ProjectionSpec = (
    tuple[int, torch.Tensor, torch.Tensor | None, int, int]
    | tuple[list[ShardSpec], torch.Tensor | None, int, int]
)


def projection_spec(module: nn.Module) -> ProjectionSpec:
    """A projection's weights as the C++ decoder reads them (ProjectionSpec)."""
    if isinstance(module, ShardedPackedLinear):
        shards = [(s.bits, s.blocks, s.out_features) for s in module.packed_shards]
        return shards, module.bias, module.out_features, module.in_features
    if isinstance(module, PackedLinear):
        return module.bits, module.blocks, module.bias, module.out_features, module.in_features
    if isinstance(module, Linear) and module.weight.dtype == torch.float32:
        weight = module.weight.detach()
        return 32, weight.contiguous(), module.bias, weight.shape[0], weight.shape[1]
    raise TypeError(f"{type(module).__name__} has no fused-decode form")


def enable_fused_decode(
    model: Any, kv_caches: Sequence[object], deterministic: bool = False
) -> str | None:
    """Run `model`'s decode-only steps through the fused C++ step if it can run them; returns
    why not (None: enabled). The target's and a draft model's weights go through this one gate.
    `deterministic`: its other steps attend row by row as decode does (FusedDecoder)."""
    switch = model.fused_decode
    if switch is None:
        return f"{type(model).__name__} has none"
    reason = unsupported_reason(model, kv_caches)
    if reason is None:
        switch.enable(deterministic=deterministic)
    return reason


# The model is duck-typed (`Any`): any Llama-shaped decoder (embed_tokens, layers with
# self_attn.qkv_proj / o_proj and mlp.gate_up_proj / down_proj, norm, rotary) can run fused.
def unsupported_reason(model: Any, kv_caches: Sequence[object]) -> str | None:
    """Why the fused step cannot run this model and cache (None: it can)."""
    if not native.is_available():
        return "densa's C++ kernels are not built here"
    if getattr(model, "embed_tokens", None) is None or getattr(model, "layers", None) is None:
        return "not a Llama-family model"
    if model.norm.weight.dtype != torch.float32:
        return "compute dtype is not float32"
    table = getattr(model.embed_tokens, "weight", None)
    if table is not None and table.dtype != torch.float32:
        return "the embedding table is not float32"
    family = _family_reason(model)
    if family is not None:
        return family
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                     layer.mlp.down_proj):  # fmt: skip
            try:
                projection_spec(proj)
            except TypeError as exc:
                return str(exc)
    for cache in kv_caches:
        if not isinstance(cache, LayerKVCache):
            return "latent (MLA) KV pages have no fused-decode form"
        if cache.k.dtype not in _KV_DTYPES or not cache.k.is_contiguous():
            return f"KV cache dtype {cache.k.dtype} has no fused-decode form"
        if cache.k.device.type != "cpu":
            return "the KV cache is not on the CPU"
    return None


def _family_reason(model: Any) -> str | None:
    """The C++ step computes plain Llama layers: anything a subclass adds runs eagerly."""
    if getattr(model, "qk_norm", False):
        return "q/k head norms (Qwen3) have no fused-decode form"
    if any(w is not None for w in getattr(model.cfg, "layer_windows", ())):
        return "sliding-window layers have no fused-decode form"
    for layer in model.layers:
        if not hasattr(layer.mlp, "gate_up_proj"):
            return f"{type(layer.mlp).__name__} MLPs (mixture of experts) have no fused-decode form"
    return None


class FusedDecoder:
    """The C++ decoder for one model and one set of KV caches (built once, reused every step)."""

    def __init__(
        self, model: Any, kv_caches: list[LayerKVCache], deterministic: bool = False
    ) -> None:
        reason = unsupported_reason(model, kv_caches)
        if reason is not None:
            raise ValueError(f"the fused decode step cannot run: {reason}")
        ext = native.load()
        assert ext is not None  # unsupported_reason checked it
        cfg = model.cfg
        shape = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                 cfg.head_dim, float(model.norm.eps))  # fmt: skip
        # A float32 table is indexed in C++; any other (GGUFEmbedding: quantized rows) is
        # looked up here and its rows handed to each step.
        table = getattr(model.embed_tokens, "weight", None)
        self._lookup = None if table is not None else model.embed_tokens
        if table is None:
            table = torch.empty(0, cfg.hidden_size)
        self._decoder: Any = ext.Decoder(
            shape, native.isa(), table.detach(),
            model.norm.weight.detach(), model.rotary.cos, model.rotary.sin, native.fp8_table(),
        )  # fmt: skip
        for layer, cache in zip(model.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            self._decoder.add_layer(
                norms[0].detach(), norms[1].detach(),
                projection_spec(attn.qkv_proj), projection_spec(attn.o_proj),
                projection_spec(mlp.gate_up_proj), projection_spec(mlp.down_proj),
                cache.k, cache.k_scale, cache.v, cache.v_scale, attn.k_center,
            )  # fmt: skip
        self.key = cache_key(kv_caches)
        self.caches = list(kv_caches)
        self.deterministic = deterministic
        # Deterministic: decode steps attend through the tiled kernel too, as prefill rows do.
        self._decoder.set_tiled_attention(deterministic)

    def forward_layers(
        self,
        model: Any,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Any step (prefill chunks, mixed): each layer's norms, projections, RoPE, K/V store
        and MLP in two C++ calls, its attention through `backend` (SDPA for prefill chunks, as
        the eager model) -> final hidden states [T, hidden].

        Deterministic, every row attends through the tiled kernel reading every position from
        the pages (C++ `attend_tiled` over `step_sequences`), as decode steps do then too, so a
        row computes the same whatever chunk, batch or cache hit it came in."""
        rows = step_sequences(meta) if self.deterministic else None
        residual = model.embed_tokens(input_ids).contiguous()  # [T, hidden], updated in place
        for idx, cache in enumerate(self.caches):
            qkv = self._decoder.qkv(
                idx, residual, positions, meta.slot_pages, meta.slot_offsets
            )  # [T, q + 2 kv]: rotated; K/V already stored
            if rows is not None:
                attn = self._decoder.attend_tiled(idx, qkv, *rows)  # [T, q]
            else:
                attn = self._backend_attention(model.cfg, qkv, cache, meta, backend)
            self._decoder.mlp(idx, attn.contiguous(), residual)
        out: torch.Tensor = self._decoder.final_norm(residual)
        return out

    @staticmethod
    def _backend_attention(
        cfg: Any,
        qkv: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """qkv [T, q + 2 kv] -> the backend's attention [T, q] (the stored K/V read back)."""
        num_tokens, head_dim = qkv.shape[0], cfg.head_dim
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        attn = attend_stored(
            backend,
            q.view(num_tokens, -1, head_dim),
            k.view(num_tokens, -1, head_dim),
            v.view(num_tokens, -1, head_dim),
            cache, meta, head_dim**-0.5,
        )  # fmt: skip
        return attn.reshape(num_tokens, cfg.q_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Decode rows only (meta.prefill is None) -> final hidden states [T, hidden]."""
        group = meta.decode
        assert group is not None and meta.prefill is None
        rows = None if self._lookup is None else self._lookup(input_ids).contiguous()
        out: torch.Tensor = self._decoder.forward(
            input_ids.contiguous(), positions.contiguous(), group.page_table.contiguous(),
            group.seq_lens.contiguous(), meta.slot_pages.contiguous(),
            meta.slot_offsets.contiguous(), rows,
        )  # fmt: skip
        return out


def step_sequences(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's sequences in row order, decode rows first: (page table [B, max_pages],
    seq_lens [B], query_lens [B]) int32, for the deterministic mode's tiled attention.

        decode row:                 query_len 1, its seq_len
        prefill chunk i:            query_len q, seq_len L (rows at positions L - q .. L - 1)

    The tiled kernel reads every position, a chunk's own included, from the pages and reduces a
    row in an order fixed by its position: a prompt position computes the same bits as it would
    in any chunk, after a prefix hit, or as a decode step."""
    groups = [g for g in (meta.decode, meta.prefill) if g is not None]  # the rows' order
    width = max(g.page_table.shape[1] for g in groups)
    tables = [
        torch.nn.functional.pad(g.page_table, (0, width - g.page_table.shape[1])) for g in groups
    ]
    seq_lens = torch.cat([g.seq_lens for g in groups])
    query_lens = torch.cat([g.query_lens for g in groups])
    return (
        torch.cat(tables).int().contiguous(),
        seq_lens.int().contiguous(),
        query_lens.int().contiguous(),
    )


def cache_key(kv_caches: list[LayerKVCache]) -> tuple[int, ...]:
    """Identifies a set of KV tensors: the decoder holds pointers into exactly these."""
    return tuple(t.data_ptr() for c in kv_caches for t in (c.k, c.v))


class FusedDecodeSwitch:
    """Whether (and with which decoder) a model runs decode-only steps fused.

    Off until `enable()`; the decoder is built on the first decode-only step, for the KV tensors
    that step uses, and rebuilt if they ever change."""

    def __init__(self) -> None:
        self.enabled = False
        self.deterministic = False  # every row attends as a decode row (--deterministic)
        self._decoder: FusedDecoder | None = None

    def enable(self, on: bool = True, deterministic: bool = False) -> None:
        self.enabled = on
        if deterministic != self.deterministic:
            self.deterministic, self._decoder = deterministic, None

    def reset(self) -> None:
        """Forget the built decoder: the next decode step builds one from the model as it is
        then (after anything the decoder copied at build time changed, e.g. key centers)."""
        self._decoder = None

    def decoder_for(self, model: Any, kv_caches: list[LayerKVCache]) -> FusedDecoder | None:
        """The decoder for these KV tensors, or None when fused steps are off."""
        if not self.enabled:
            return None
        if self._decoder is None or self._decoder.key != cache_key(kv_caches):
            self._decoder = FusedDecoder(model, kv_caches, self.deterministic)
        return self._decoder
