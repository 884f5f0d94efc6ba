"""Sizing a deployment from a config.json alone: weights per GPU in each weight format and the
KV tokens the rest of the GPU holds in each KV format, at a tensor-parallel degree.

Parameters are counted from the config (no weights, no model class: GLM-4.5 sizes like any
other). What tensor parallelism splits, as vLLM and SGLang shard these models:

    split across TP ranks            replicated on every rank
    embedding, head (vocab-parallel)  norms, routers (+ correction bias)
    q/k/v/o, MLA's q_b/kv_b/o         MLA's q_a and kv_a (small; ReplicatedLinear)
    dense MLPs, routed and shared     -
      experts (their widths split)
    GQA KV heads (each rank its        MLA's latent KV (every rank caches the whole latent
      share; at least one)               of every token: it is not split by heads)
    -                                  DSA's indexer (wq_b, wk, weights_proj, its LayerNorm)
                                         and its index keys (one per token, not per head)

Weight formats (bytes per parameter of the linear layers; everything else stays bf16):
bf16 2; fp8 e4m3 1 + 4 / 128^2 (one fp32 scale per 128 x 128 block, as DeepSeek/Kimi/GLM ship
it); int4 g32 0.5 + 2 / 32 (a bf16 scale per 32 inputs: Kimi K2-Thinking's format and densa's
`--group-size 32`); mxfp4 0.5 + 1 / 32 (an E8M0 byte per 32: gpt-oss's and DeepSeek-V4's experts,
alone or with the rest in bf16 / fp8 as they ship); nvfp4 0.5 + 1 / 16 (an e4m3 byte per 16;
its per-tensor float32 is negligible); MLA's kv_b_proj kept bf16 as densa does (absorbed into
decode). Multi-token
prediction layers (`num_nextn_predict_layers`) ship in checkpoints but are not served: they are
counted in the checkpoint size only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.model.kv_pages import bytes_per_token
from densa.utils.sizes import format_bytes

BF16 = 2.0
FP8_LINEAR = 1.0 + 4 / (128 * 128)
INT4_G32_LINEAR = 0.5 + 2 / 32
MXFP4_LINEAR = 0.5 + 1 / 32
NVFP4_LINEAR = 0.5 + 1 / 16
# Total memory as the driver reports it (nvidia-smi), bytes.
GPUS = {"h100": 81_559 * 2**20, "h200": 143_771 * 2**20}
DENSE_KV_ARCH = "LlamaForCausalLM"
KV_FORMATS = (KVFormat.of("bfloat16"), KVFormat.of("fp8_e4m3", "dynamic"), KVFormat.of("int8"))


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the served model (one of each layer), by how they shard and quantize."""

    split_linear: int  # split across TP ranks, quantized
    replicated_linear: int  # every rank holds it, quantized (MLA's q_a / kv_a)
    kept_linear: int  # split, but densa keeps it bf16 under int4 (MLA's kv_b_proj)
    routed_experts: int  # split, quantized (part of split_linear)
    split_other: int  # embedding and head: split, bf16
    replicated_other: int  # norms and routers: replicated, bf16
    mtp: int  # multi-token-prediction layers: in the checkpoint, not served

    @property
    def served(self) -> int:
        return (
            self.split_linear + self.replicated_linear + self.kept_linear
            + self.split_other + self.replicated_other
        )  # fmt: skip


@dataclass(frozen=True)
class WeightFormatSize:
    name: str
    checkpoint_bytes: int
    per_gpu_bytes: int
    arithmetic: str


def count_parameters(cfg: dict[str, Any], arch: ArchConfig) -> ParamCounts:
    """Every parameter of the served layers, plus the checkpoint's MTP layers (each one MoE
    layer and an eh_proj [h, 2h] with two norms)."""
    flags = _moe_flags(arch)
    full = arch.dsa.full_layers if arch.dsa is not None else (False,) * arch.num_layers
    layers = [_layer(arch, is_moe, indexed) for is_moe, indexed in zip(flags, full, strict=True)]
    h = arch.hidden_size
    head = 0 if arch.tie_word_embeddings else arch.vocab_size * h
    mtp_layers = int(cfg.get("num_nextn_predict_layers") or 0)
    mtp_layer = _layer(arch, arch.moe is not None, arch.dsa is not None)  # its own indexer
    mtp = mtp_layers * (sum(mtp_layer) + 2 * h * h + 2 * h)
    return ParamCounts(
        split_linear=sum(layer[0] + layer[3] for layer in layers),
        replicated_linear=sum(layer[1] for layer in layers),
        kept_linear=sum(layer[2] for layer in layers),
        routed_experts=sum(layer[3] for layer in layers),
        split_other=arch.vocab_size * h + head,
        replicated_other=sum(layer[4] for layer in layers) + h,  # + the final norm
        mtp=mtp,
    )


def _moe_flags(arch: ArchConfig) -> tuple[bool, ...]:
    return arch.moe.moe_layers if arch.moe is not None else (False,) * arch.num_layers


def _layer(arch: ArchConfig, is_moe: bool, indexed: bool) -> tuple[int, int, int, int, int]:
    """One layer's (split linear, replicated linear, kept bf16, routed experts, norms and
    router) parameters; `indexed`: it runs a DSA indexer."""
    h = arch.hidden_size
    split, replicated, kept = _attention(arch)
    other = 2 * h + _mla_norms(arch)
    if indexed:
        linear, kept_bf16 = _indexer(arch)
        replicated, other = replicated + linear, other + kept_bf16
    moe = arch.moe
    if moe is None or not is_moe:
        return split + 3 * h * arch.intermediate_size, replicated, kept, 0, other
    routed = moe.num_experts * 3 * h * moe.expert_intermediate_size
    shared = 3 * h * moe.shared_intermediate_size
    router = moe.num_experts * h + moe.num_experts  # gate and its correction bias
    return split + shared, replicated, kept, routed, other + router


def _attention(arch: ArchConfig) -> tuple[int, int, int]:
    """(split, replicated, kept-bf16) parameters of one layer's attention."""
    h, heads = arch.hidden_size, arch.num_heads
    mla = arch.mla
    if mla is None:
        q, kv = heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        bias = (q + 2 * kv) if arch.attention_bias else 0
        return h * q + 2 * h * kv + q * h + bias, 0, 0
    q_width = heads * mla.qk_head_dim
    if mla.q_lora_rank is None:
        split, replicated = h * q_width, 0
    else:
        split, replicated = mla.q_lora_rank * q_width, h * mla.q_lora_rank
    replicated += h * mla.latent_dim  # kv_a_proj_with_mqa
    kv_b = mla.kv_lora_rank * heads * (mla.nope_head_dim + mla.v_head_dim)
    o = heads * mla.v_head_dim * h
    return split + o, replicated, kv_b


def _indexer(arch: ArchConfig) -> tuple[int, int]:
    """(replicated linear: wq_b and wk, shipped in FP8; replicated bf16: weights_proj, kept high
    precision as densa keeps it, and the key's LayerNorm) of one DSA indexer."""
    assert arch.dsa is not None and arch.mla is not None
    dsa = arch.dsa
    wq_b = (arch.mla.q_lora_rank or 0) * dsa.num_heads * dsa.head_dim
    return (
        wq_b + arch.hidden_size * dsa.head_dim,
        arch.hidden_size * dsa.num_heads + 2 * dsa.head_dim,
    )


def _mla_norms(arch: ArchConfig) -> int:
    if arch.mla is None:
        return 0
    return arch.mla.kv_lora_rank + (arch.mla.q_lora_rank or 0)


def weight_sizes(counts: ParamCounts, tp: int) -> list[WeightFormatSize]:
    """Checkpoint and per-GPU bytes in bf16, fp8 blocks, int4 g32, mxfp4 and nvfp4 (all
    linears, and routed experts only as Kimi K2-Thinking, gpt-oss and DeepSeek-V4 ship them)."""
    recipes = {
        # name: bytes/param of (routed experts, other quantized linears, kv_b_proj)
        "bf16": (BF16, BF16, BF16),
        "fp8 128x128": (FP8_LINEAR, FP8_LINEAR, FP8_LINEAR),
        "int4 g32": (INT4_G32_LINEAR, INT4_G32_LINEAR, BF16),
        "int4 g32 experts, rest fp8": (INT4_G32_LINEAR, FP8_LINEAR, FP8_LINEAR),
        "mxfp4": (MXFP4_LINEAR, MXFP4_LINEAR, BF16),
        "mxfp4 experts, rest bf16": (MXFP4_LINEAR, BF16, BF16),  # gpt-oss as it ships
        "mxfp4 experts, rest fp8": (MXFP4_LINEAR, FP8_LINEAR, FP8_LINEAR),  # DeepSeek-V4's mix
        "nvfp4": (NVFP4_LINEAR, NVFP4_LINEAR, BF16),
    }
    sizes = []
    for name, (experts, linear, kv_b) in recipes.items():
        other_split = counts.split_linear - counts.routed_experts
        split = (
            counts.routed_experts * experts + other_split * linear + counts.kept_linear * kv_b
            + counts.split_other * BF16
        )  # fmt: skip
        replicated = counts.replicated_linear * linear + counts.replicated_other * BF16
        mtp = counts.mtp * (linear if name != "bf16" else BF16)
        arithmetic = (
            f"({_b(counts.routed_experts)} experts x {experts:.4g} + {_b(other_split)} linear x "
            f"{linear:.4g} + {_b(counts.kept_linear)} kv_b x {kv_b:.4g} + "
            f"{_b(counts.split_other)} embed/head x 2) / {tp} + {_b(counts.replicated_linear)} "
            f"x {linear:.4g} + {_b(counts.replicated_other)} x 2"
        )
        sizes.append(
            WeightFormatSize(
                name,
                checkpoint_bytes=int(split + replicated + mtp),
                per_gpu_bytes=int(split / tp + replicated),
                arithmetic=arithmetic,
            )
        )
    return sizes


def _b(count: int) -> str:
    return f"{count / 1e9:.2f}B"


def kv_bytes_per_token_per_gpu(arch: ArchConfig, kv_format: KVFormat, tp: int) -> int:
    """One token's KV bytes on one rank: GQA heads split (at least one per rank), MLA's latent
    whole on every rank."""
    if arch.mla is None:
        # Sized as densa caches any GQA model (dense K/V pages), whether or not densa has a
        # model class for the architecture (GLM-4.5 has none yet).
        per_rank = max(1, math.ceil(arch.num_kv_heads / tp))
        arch = replace(arch, architecture=DENSE_KV_ARCH, num_kv_heads=per_rank)
    return bytes_per_token(arch, kv_format)


@dataclass(frozen=True)
class KVRow:
    weights: str
    kv_dtype: str
    budget_bytes: int
    bytes_per_token: int

    @property
    def tokens(self) -> int:
        return max(self.budget_bytes, 0) // self.bytes_per_token


def kv_rows(
    arch: ArchConfig, sizes: list[WeightFormatSize], gpu_bytes: int, utilization: float,
    reserve_bytes: int, tp: int,
) -> list[KVRow]:  # fmt: skip
    usable = int(gpu_bytes * utilization) - reserve_bytes
    rows = []
    for size in sizes:
        for kv_format in KV_FORMATS:
            per_token = kv_bytes_per_token_per_gpu(arch, kv_format, tp)
            rows.append(KVRow(size.name, kv_format.name, usable - size.per_gpu_bytes, per_token))
    return rows


def format_deployment(
    name: str, arch: ArchConfig, counts: ParamCounts, sizes: list[WeightFormatSize],
    rows: list[KVRow], gpu: str, gpu_bytes: int, utilization: float, reserve: int, tp: int,
) -> str:  # fmt: skip
    lines = [
        f"{name} ({arch.architecture}): {counts.served / 1e9:.1f}B parameters served "
        f"(+{counts.mtp / 1e9:.1f}B multi-token prediction in the checkpoint), "
        f"{tp} x {gpu} ({format_bytes(gpu_bytes)} each), TP{tp}",
        "",
        "| weights | checkpoint | per GPU | per GPU = |",
        "|---|---|---|---|",
    ]
    for size in sizes:
        lines.append(
            f"| {size.name} | {size.checkpoint_bytes / 1e9:.1f} GB "
            f"| {size.per_gpu_bytes / 1e9:.2f} GB | {size.arithmetic} |"
        )
    usable = int(gpu_bytes * utilization) - reserve
    lines += [
        "",
        f"KV budget per GPU = {format_bytes(gpu_bytes)} x {utilization} - "
        f"{format_bytes(reserve)} reserve (activations, graphs) - weights per GPU "
        f"= {usable / 1e9:.2f} GB - weights",
        f"KV per token per GPU: {_describe_kv(arch, tp)}",
        "",
        "| weights | KV dtype | KV budget per GPU | bytes/token/GPU | resident tokens "
        "| tokens vs bf16 KV |",
        "|---|---|---|---|---|---|",
    ]
    baseline = {r.weights: r.tokens for r in rows if r.kv_dtype == "bfloat16"}
    for row in rows:
        if row.budget_bytes <= 0:
            lines.append(f"| {row.weights} | {row.kv_dtype} | weights do not fit | - | 0 | - |")
            continue
        ratio = row.tokens / max(baseline[row.weights], 1)
        lines.append(
            f"| {row.weights} | {row.kv_dtype} | {row.budget_bytes / 1e9:.2f} GB "
            f"| {row.bytes_per_token} | {row.tokens:,} | {ratio:.3f}x |"
        )
    return "\n".join(lines)


def _describe_kv(arch: ArchConfig, tp: int) -> str:
    if arch.mla is not None:
        return (
            f"{arch.num_layers} layers x MLA latent {arch.mla.latent_dim} values, whole on "
            "every rank (not split by TP)"
            + ("" if arch.dsa is None else ", + " + arch.dsa.describe())
        )
    per_rank = max(1, math.ceil(arch.num_kv_heads / tp))
    return (
        f"{arch.num_layers} layers x 2 (K, V) x {per_rank} of {arch.num_kv_heads} KV heads "
        f"x head_dim {arch.head_dim}"
    )
