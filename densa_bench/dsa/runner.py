"""`densa bench dsa`: decode with DeepSeek Sparse Attention (the indexer's top 2048) vs dense MLA
(every cached token), by context length, on a random model with GLM-5's attention.

No GLM-5 weights ship, and a 2-core CPU cannot prefill 32k tokens of a 6144-wide model, so the
benchmark builds the real model class (GlmMoeDsaForCausalLM) with GLM-5's attention dims (64
heads, q-LoRA 2048, latent 512 + 64, indexer 32 heads x 128, top-k 2048) but few layers and
small experts, fills its KV pages with random latents and index keys up to each context length
(what attention costs does not depend on the values), and times one decode step:

    dsa     the indexer scores every cached token, MLA attends to the top 2048 (decode reads
            only those latent rows: densa.kernels.cpu.sparse_latent_decode)
    dense   the same weights with every token attended (absorbed MLA over all latent rows)

and, apart from the projections (whose cost does not grow with the context), the attention
alone: indexer scoring + top-k + sparse decode vs dense absorbed decode, one layer. KV bytes
read per step are counted from what each path reads: the index keys of every cached token and
k latent rows (DSA), or every latent row (dense).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.model.attention import AttentionMetadata, CpuAttentionBackend, build_group
from densa.model.deepseek_v32 import GlmMoeDsaForCausalLM, SparseMLAttention
from densa.model.dsa import Indexer, hadamard_rotate
from densa.model.kv_layout import LatentKVCache
from densa.model.kv_pages import allocate_kv_caches, bytes_per_token
from densa.model.latent_attention import absorbed_decode, sparse_absorbed_decode
from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.dsa.settings import DsaSettings

PAGE_SIZE = 64
DENSE_TOPK = 1 << 30  # "every token": the indexer's choice is skipped
# GLM-5's attention (tests/fixtures/configs/glm-5): what decode reads and computes per layer.
GLM5_ATTENTION: dict[str, Any] = {
    "hidden_size": 6144, "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
    "v_head_dim": 256, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
}  # fmt: skip
# Layers in the released models, and how many run an indexer (the rest reuse its choice).
REAL_LAYERS = {"GLM-5 (every layer indexed)": (78, 78), "GLM-5.2 (21 of 78 indexed)": (78, 21)}


def model_config(
    settings: DsaSettings, attention: dict[str, Any] = GLM5_ATTENTION
) -> dict[str, Any]:
    return attention | {
        "architectures": ["GlmMoeDsaForCausalLM"], "vocab_size": 4096,
        "num_hidden_layers": settings.num_layers, "intermediate_size": 2048,
        "moe_intermediate_size": settings.expert_intermediate_size,
        "n_routed_experts": settings.num_experts,
        "num_experts_per_tok": min(2, settings.num_experts),
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5,
        "max_position_embeddings": max(settings.contexts) + 1, "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    }  # fmt: skip


def random_model(arch: ArchConfig, settings: DsaSettings) -> GlmMoeDsaForCausalLM:
    """The model class with random weights (fan-in scaled), in the settings' dtype."""
    torch.manual_seed(settings.seed)
    model = GlmMoeDsaForCausalLM(arch, max(settings.contexts) + 1, torch.device("cpu"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                param.normal_(0, param.shape[-1] ** -0.5)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[settings.dtype]
    return model.to(dtype).eval()


def _set_topk(model: nn.Module, topk: int) -> None:
    for module in model.modules():
        if isinstance(module, Indexer):
            module.topk = topk


def filled_caches(arch: ArchConfig, context: int, kv_dtype: str) -> list[LatentKVCache]:
    """Pages of every layer holding random latents and index keys at positions [0, context)."""
    num_pages = -(-context // PAGE_SIZE)
    caches = allocate_kv_caches(
        arch, num_pages, PAGE_SIZE, KVFormat.of(kv_dtype), torch.device("cpu")
    )
    gen = torch.Generator().manual_seed(1)
    for cache in caches:
        assert isinstance(cache, LatentKVCache)
        for values in (cache.latent, *([] if cache.index is None else [cache.index.keys])):
            real = torch.randn(values.shape, generator=gen)
            if values.dtype == torch.float8_e4m3fn:  # the scales stay 0: 2^0
                real = real.clamp(-448, 448)
            values.copy_(real.to(values.dtype))
    return [c for c in caches if isinstance(c, LatentKVCache)]


def _median_ms(run: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    run()  # warm-up: kernels compiled, pages in cache
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times), max(times)


def _decode_meta(context: int) -> AttentionMetadata:
    """One decode row at position context - 1 (its latent and index key are stored anew)."""
    pages = list(range(-(-context // PAGE_SIZE)))
    pos = context - 1
    group = build_group(0, [pages], [context], [1], PAGE_SIZE, torch.device("cpu"))
    return AttentionMetadata(
        torch.tensor([pages[pos // PAGE_SIZE]]), torch.tensor([pos % PAGE_SIZE]), group, None
    )


def time_model_step(model: GlmMoeDsaForCausalLM, caches: list[LatentKVCache], context: int,
                    repeats: int) -> tuple[float, float, float]:  # fmt: skip
    meta, backend = _decode_meta(context), CpuAttentionBackend()
    ids, positions = torch.tensor([7]), torch.tensor([context - 1])

    def step() -> torch.Tensor:
        with torch.inference_mode():
            return model.compute_logits(model(ids, positions, caches, meta, backend))

    return _median_ms(step, repeats)


def time_attention(model: GlmMoeDsaForCausalLM, cache: LatentKVCache, context: int,
                   repeats: int, chosen: int | None) -> tuple[float, float, float]:  # fmt: skip
    """One layer's attention over the context, projections excluded: the indexer's scores,
    its top `chosen` and the sparse decode (dsa), or the absorbed decode over every row (dense,
    `chosen` None)."""
    attention = model.layers[0].self_attn
    assert isinstance(attention, SparseMLAttention) and attention.indexer is not None
    indexer, m = attention.indexer, attention.m
    group = _decode_meta(context).decode
    assert group is not None and cache.index is not None
    gen = torch.Generator().manual_seed(2)
    q_latent = torch.randn(1, attention.num_heads, m.latent_dim, generator=gen)
    queries = torch.randn(1, indexer.num_heads, indexer.head_dim, generator=gen)
    if cache.index.kv_format.is_quantized:
        queries = hadamard_rotate(queries)
    weights = torch.randn(1, indexer.num_heads, generator=gen)
    index = cache.index

    def dsa() -> torch.Tensor:
        with torch.inference_mode():
            positions = indexer._select(queries, weights, index, group, as_positions=True)
            if positions is None:  # no context past the top-k: every token is attended
                return absorbed_decode(q_latent, cache, group, attention.scale, m.kv_lora_rank,
                                       "cpu")  # fmt: skip
            return sparse_absorbed_decode(q_latent, cache, group, positions, attention.scale,
                                          m.kv_lora_rank, "cpu")  # fmt: skip

    def dense() -> torch.Tensor:
        with torch.inference_mode():
            return absorbed_decode(q_latent, cache, group, attention.scale, m.kv_lora_rank, "cpu")

    topk = indexer.topk
    indexer.topk = DENSE_TOPK if chosen is None else chosen
    try:
        return _median_ms(dense if chosen is None else dsa, repeats)
    finally:
        indexer.topk = topk


def kv_bytes_read(arch: ArchConfig, kv_dtype: str, context: int, num_layers: int,
                  num_indexed: int, sparse: bool) -> int:  # fmt: skip
    """KV bytes one decode step reads over `num_layers` layers, `num_indexed` of them with an
    indexer: every latent row (dense, and DSA while the context fits in its top-k: the indexer
    is not scored), or every index key and k latent rows (DSA)."""
    assert arch.dsa is not None and arch.mla is not None
    per_row = _latent_row_bytes(arch, kv_dtype)
    if not sparse or context <= arch.dsa.topk:  # nothing to choose: every row is attended
        return num_layers * context * per_row
    index_row = (
        bytes_per_token(arch, KVFormat.of(kv_dtype)) - arch.num_layers * per_row
    )  # all indexed here
    index_row //= arch.dsa.num_full_layers
    chosen = min(context, arch.dsa.topk)
    return num_indexed * context * index_row + num_layers * chosen * per_row


def _latent_row_bytes(arch: ArchConfig, kv_dtype: str) -> int:
    """One latent row with its scale (FP8 dynamic, INT8), as the pages store it."""
    assert arch.mla is not None
    fmt = KVFormat.of(kv_dtype)
    return arch.mla.latent_dim * fmt.value_bytes() + fmt.scale_bytes_per_row()


def run_dsa(settings: DsaSettings, attention: dict[str, Any] = GLM5_ATTENTION) -> BenchReport:
    """`attention`: the attention dims (GLM-5's; tests pass smaller ones)."""
    arch = ArchConfig.from_hf_dict(model_config(settings, attention))
    assert arch.dsa is not None
    model = random_model(arch, settings)
    samples: list[dict[str, Any]] = []
    for kv_dtype in settings.kv_dtypes:
        for context in settings.contexts:
            caches = filled_caches(arch, context, kv_dtype)
            for variant, topk in (("dsa", arch.dsa.topk), ("dense", DENSE_TOPK)):
                _set_topk(model, topk)
                sparse = variant == "dsa"
                step = time_model_step(model, caches, context, settings.repeats)
                chosen = arch.dsa.topk if sparse else None
                attn = time_attention(model, caches[0], context, settings.repeats, chosen)
                samples.append({
                    "kv_dtype": kv_dtype, "context": context, "variant": variant,
                    "step_ms": step[0], "step_ms_min": step[1], "step_ms_max": step[2],
                    "attention_ms": attn[0], "attention_ms_min": attn[1],
                    "attention_ms_max": attn[2],
                    "kv_bytes_per_layer": kv_bytes_read(arch, kv_dtype, context, 1, 1, sparse),
                })  # fmt: skip
            del caches
    return _report(settings, arch, samples)


def _report(settings: DsaSettings, arch: ArchConfig, samples: list[dict[str, Any]]) -> BenchReport:
    report = BenchReport("dsa", asdict(settings), samples=samples, summary=samples)
    for kv_dtype in settings.kv_dtypes:
        rows = [s for s in samples if s["kv_dtype"] == kv_dtype]
        report.tables.append(_table(kv_dtype, rows, settings))
        report.tables.append(_real_bytes_table(arch, kv_dtype, settings.contexts))
        report.plots += _plots(kv_dtype, rows)
    report.notes += [
        f"Model: GlmMoeDsaForCausalLM with GLM-5's attention dims, {settings.num_layers} layers "
        f"(layer 0 a dense MLP, the rest {settings.num_experts} experts of "
        f"{settings.expert_intermediate_size}), vocabulary 4096, random weights in "
        f"{settings.dtype}; KV pages filled with random values, one decode row per step.",
        "step: the whole model's decode step (projections stream the same weights at every "
        "context, so the gap is attention); attention: one layer's context-dependent part.",
        "KV bytes: counted from what each path reads, per layer; the torch indexer widens the "
        "index keys it reads into a float32 copy (4 bytes per value written, not counted).",
    ]
    return report


def _pair(rows: list[dict[str, Any]], context: int) -> tuple[dict[str, Any], dict[str, Any]]:
    dsa = next(r for r in rows if r["context"] == context and r["variant"] == "dsa")
    dense = next(r for r in rows if r["context"] == context and r["variant"] == "dense")
    return dsa, dense


def _table(kv_dtype: str, rows: list[dict[str, Any]], settings: DsaSettings) -> Table:
    cells = []
    for context in settings.contexts:
        dsa, dense = _pair(rows, context)
        cells.append([
            f"{context:,}", f"{dense['step_ms']:.1f}", f"{dsa['step_ms']:.1f}",
            f"{dense['attention_ms']:.2f}", f"{dsa['attention_ms']:.2f}",
            f"{dense['attention_ms'] / dsa['attention_ms']:.2f}x",
            f"{dense['kv_bytes_per_layer'] / 1e6:.2f}", f"{dsa['kv_bytes_per_layer'] / 1e6:.2f}",
            f"{dsa['kv_bytes_per_layer'] / dense['kv_bytes_per_layer']:.3f}",
        ])  # fmt: skip
    columns = ["context", "step ms dense", "step ms DSA", "attention ms dense",
               "attention ms DSA", "attention speed-up", "KV MB/layer dense", "KV MB/layer DSA",
               "DSA / dense bytes"]  # fmt: skip
    return Table(f"{kv_dtype} pages: decode step (batch 1), medians", columns, cells)


def _real_bytes_table(arch: ArchConfig, kv_dtype: str, contexts: tuple[int, ...]) -> Table:
    rows = []
    for name, (layers, indexed) in REAL_LAYERS.items():
        for context in contexts:
            dense = kv_bytes_read(arch, kv_dtype, context, layers, layers, False)
            sparse = kv_bytes_read(arch, kv_dtype, context, layers, indexed, True)
            rows.append([name, f"{context:,}", f"{dense / 1e6:.1f}", f"{sparse / 1e6:.1f}",
                         f"{sparse / dense:.3f}"])  # fmt: skip
    columns = ["model", "context", "dense MB/step", "DSA MB/step", "DSA / dense"]
    return Table(f"{kv_dtype} pages: KV bytes a decode step reads, whole model", columns, rows)


def _plots(kv_dtype: str, rows: list[dict[str, Any]]) -> list[LinePlot]:
    def series(variant: str, key: str, label: str) -> Series:
        mine = [r for r in rows if r["variant"] == variant]
        return Series(label, [r["context"] for r in mine], [r[key] for r in mine],
                      [r.get(f"{key}_min", r[key]) for r in mine],
                      [r.get(f"{key}_max", r[key]) for r in mine])  # fmt: skip

    tag = kv_dtype.replace("_", "-")
    return [
        LinePlot(f"attention_{tag}", f"One layer's decode attention ({kv_dtype} pages)",
                 "context (tokens)", "ms", [series("dense", "attention_ms", "dense MLA"),
                 series("dsa", "attention_ms", "DSA (top-k)")], log_x=True),
        LinePlot(f"step_{tag}", f"Decode step ({kv_dtype} pages)", "context (tokens)", "ms",
                 [series("dense", "step_ms", "dense MLA"), series("dsa", "step_ms", "DSA")],
                 log_x=True),
        LinePlot(f"kv_bytes_{tag}", f"KV bytes read per layer ({kv_dtype} pages)",
                 "context (tokens)", "bytes", [series("dense", "kv_bytes_per_layer", "dense MLA"),
                 series("dsa", "kv_bytes_per_layer", "DSA")], log_x=True),
    ]  # fmt: skip
