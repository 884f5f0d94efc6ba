"""Quantized checkpoints written the way their producers write them, and each format's own
dequantization, for tests of densa.quant.shipped.

compressed-tensors is the real library (its compressors pack and unpack). AutoAWQ and AutoGPTQ
need CUDA to install, so their packing and dequantization are written here once, slowly and
literally, from their code (AutoAWQ WQLinear_GEMM.from_linear and its reverse order; AutoGPTQ
QuantLinear.pack with `zeros -= 1` and its forward's `zeros + 1`); DeepSeek's from
inference/kernel.py weight_dequant (y = x * s per 128 x 128 block). None of them calls densa.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Parts = dict[str, torch.Tensor]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
FP8_MAX = 448.0

# The linear weights producers quantize (routers, embeddings, norms and the head stay dense).
# DeepSeek-V3.2 also ships its indexer's wq_b and wk in FP8 (weights_proj stays bf16).
QUANTIZED = re.compile(
    r"(\.(q|k|v|o|gate|up|down|q_a|q_b|kv_a|kv_b)_proj(_with_mqa)?|\.indexer\.(wq_b|wk))\.weight$"
)


# ---- DeepSeek-V3 FP8 ----------------------------------------------------------------------------
def deepseek_fp8(weight: torch.Tensor, block: int = 128) -> Parts:
    n, k = weight.shape
    scale = torch.empty(-(-n // block), -(-k // block))
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * block : (i + 1) * block, j * block : (j + 1) * block]
            s = max(float(tile.abs().max()), 1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / s).to(q.dtype)
    return {"weight": q, "weight_scale_inv": scale}


def deepseek_dequant(parts: Parts, block: int = 128) -> torch.Tensor:
    """inference/kernel.py weight_dequant: every block times its scale_inv."""
    q, s = parts["weight"].float(), parts["weight_scale_inv"]
    out = torch.empty_like(q)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = q[rows, cols] * s[i, j]
    return out


FP8_CONFIG = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}  # fmt: skip


# ---- compressed-tensors -------------------------------------------------------------------------
def ct_scheme(kind: str, group_size: int = 32, symmetric: bool = True) -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if kind == "int4":
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric,
                                   strategy="group", group_size=group_size)  # fmt: skip
        return QuantizationScheme(targets=["Linear"], weights=weights)
    strategy = "block" if kind == "fp8-block" else "channel"
    weights = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True,
                               block_structure=[128, 128] if strategy == "block" else None)  # fmt: skip
    inputs = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True)
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)


def ct_compressor(scheme: Any) -> Any:
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    int4 = scheme.weights.type == "int"
    return PackedQuantizationCompressor if int4 else FloatQuantizationCompressor


def ct_scales(weight: torch.Tensor, scheme: Any) -> Parts:
    """Scales (and zero points) as an observer would choose them, in the model's bf16."""
    args = scheme.weights
    if args.type == "float":
        if args.strategy == "block":
            blocks = deepseek_fp8(weight)["weight_scale_inv"]
            return {"weight_scale": blocks.to(torch.bfloat16)}
        scale = weight.abs().amax(dim=1, keepdim=True) / FP8_MAX
        return {"weight_scale": scale.to(torch.bfloat16)}
    groups = weight.reshape(weight.shape[0], -1, args.group_size)
    if args.symmetric:
        return {"weight_scale": (groups.abs().amax(-1) / 7.5).to(torch.bfloat16)}
    low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = ((high - low) / 15).to(torch.bfloat16)
    zero = torch.clamp(torch.round(-low / scale.float()) - 8, -8, 7).to(torch.int8)
    return {"weight_scale": scale, "weight_zero_point": zero}


def ct_compress(weight: torch.Tensor, scheme: Any) -> Parts:
    state = {"weight": weight.to(torch.bfloat16), **ct_scales(weight, scheme)}
    return dict(ct_compressor(scheme).compress(state, scheme))


def ct_dequant(parts: Parts, scheme: Any) -> torch.Tensor:
    """compressed-tensors' own decompression, with scales widened to float32 so its product
    (q - zp) * s is exact: the bf16 result it gives by default is this, rounded."""
    state = {k: v.float() if k == "weight_scale" else v for k, v in parts.items()}
    return ct_compressor(scheme).decompress(state, scheme)["weight"]


def ct_config(scheme: Any, fmt: str) -> dict[str, Any]:
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt,
                                quantization_status="compressed", ignore=["lm_head"])  # fmt: skip
    return config.model_dump(mode="json")


# ---- compressed-tensors FP4 (mxfp4- / nvfp4-pack-quantized) --------------------------------------
def ct_fp4_scheme(kind: str) -> Any:
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4A16, NVFP4A16

    preset = MXFP4A16 if kind == "mxfp4" else NVFP4A16
    return QuantizationScheme(targets=["Linear"], weights=preset["weights"])


def _ct_fp4_compressor(kind: str) -> Any:
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    return MXFP4PackedCompressor if kind == "mxfp4" else NVFP4PackedCompressor


def ct_fp4_compress(weight: torch.Tensor, kind: str) -> Parts:
    """compressed-tensors' observer math (its calculate_qparams / generate_gparam) for the
    scales, then its compressor packs."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = ct_fp4_scheme(kind)
    args = scheme.weights
    groups = weight.reshape(weight.shape[0], -1, args.group_size)
    state: Parts = {"weight": weight.to(torch.bfloat16)}
    global_scale = None
    if kind == "nvfp4":
        global_scale = generate_gparam(weight.min(), weight.max())
        state["weight_global_scale"] = global_scale
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale)
    state["weight_scale"] = scale
    return dict(_ct_fp4_compressor(kind).compress(state, scheme))


def ct_fp4_dequant(parts: Parts, kind: str) -> torch.Tensor:
    """compressed-tensors' own decompression (its result is bfloat16)."""
    return _ct_fp4_compressor(kind).decompress(dict(parts), ct_fp4_scheme(kind))["weight"]


# ---- NVIDIA ModelOpt NVFP4 ----------------------------------------------------------------------
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def modelopt_nvfp4(weight: torch.Tensor) -> Parts:
    """ModelOpt's NVFP4QTensor.quantize, written from its code: weight_scale_2 = amax / (6 *
    448), per-16 scales amax / (6 * weight_scale_2) as e4m3, elements rounded to the nearest
    e2m1 value (ties to the even code) of w / (scale * weight_scale_2), packed low nibble first."""
    n, k = weight.shape
    scale_2 = weight.abs().max().float() / (6.0 * 448.0)
    blocks = weight.float().reshape(n, k // 16, 16)
    block_scale = (blocks.abs().amax(-1) / (6.0 * scale_2)).clamp(max=448).to(torch.float8_e4m3fn)
    scaled = blocks / (block_scale.float() * scale_2).unsqueeze(-1)
    grid = torch.tensor(E2M1)
    distance = (scaled.abs().unsqueeze(-1) - grid).abs()  # [..., 8]
    # nearest; on a tie the lower index with an even code (the e2m1 codes 0, 2, 4, 6 are even)
    best = torch.argmin(distance + (torch.arange(8) % 2) * 1e-6, dim=-1)
    codes = (best | ((scaled < 0).to(torch.int64) << 3)).reshape(n, k).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return {"weight": packed, "weight_scale": block_scale, "weight_scale_2": scale_2.reshape(()),
            "input_scale": torch.tensor(0.05)}  # fmt: skip


def modelopt_dequant(parts: Parts) -> torch.Tensor:
    """ModelOpt's dequantize: e2m1 values times (weight_scale * weight_scale_2) per block."""
    packed = parts["weight"]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    values = torch.tensor(E2M1)[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    scale = parts["weight_scale"].float() * parts["weight_scale_2"].float()
    return values * scale.repeat_interleave(16, dim=1)


MODELOPT_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                   "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"],
                   "producer": {"name": "modelopt", "version": "0.37.0"}}  # fmt: skip


# ---- gpt-oss MXFP4 (as openai/gpt-oss-20b ships its experts) -------------------------------------
def gpt_oss_mxfp4(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers gpt-oss expert parameter [E, in, out] -> (`_blocks` [E, out, in/32, 16],
    `_scales` [E, out, in/32]) in the layout gpt-oss ships, written from the OCP MX spec (sec.
    6.3): per 32 inputs the shared exponent floor(log2 max|v|) - 2 as E8M0 (bias 127), elements
    rounded to the nearest e2m1 value (ties to the even code), saturating at 6; two codes per
    byte, the even input in the low nibble."""
    weight = dense.transpose(1, 2).float()  # [E, out, in]: blocks are out-major
    experts, out, inp = weight.shape
    groups = weight.reshape(experts, out, inp // 32, 32)
    amax = groups.abs().amax(-1)
    exponent = torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - 2
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -127))
    scaled = groups / torch.pow(2.0, exponent).unsqueeze(-1)
    grid = torch.tensor(E2M1)
    distance = (scaled.abs().clamp(max=6.0).unsqueeze(-1) - grid).abs()
    best = torch.argmin(distance + (torch.arange(8) % 2) * 1e-6, dim=-1)
    codes = (best | ((scaled < 0) & (best > 0)).to(torch.int64) << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [E, out, in/32, 16]
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def write_gpt_oss_mxfp4(src: Path, out: Path, ref: Path) -> None:
    """Rewrite a dense tiny gpt-oss checkpoint (`src`) with its experts in MXFP4 as gpt-oss ships
    them (into `out`, with its quantization_config), and a dense one whose experts are
    transformers' own dequantization of those blocks (integrations/mxfp4.py; into `ref`)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    stored, reference = {}, {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if not re.search(r"\.mlp\.experts\.(gate_up|down)_proj$", name):
            stored[name] = reference[name] = tensor
            continue
        blocks, scales = gpt_oss_mxfp4(tensor)
        stored[f"{name}_blocks"], stored[f"{name}_scales"] = blocks, scales
        reference[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    config = {"quant_method": "mxfp4",
              "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                         "model.embed_tokens", "lm_head"]}  # fmt: skip
    for directory, tensors, quantization in ((out, stored, config), (ref, reference, None)):
        shutil.copytree(src, directory, dirs_exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  str(directory / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
        settings = json.loads((directory / "config.json").read_text())
        settings.pop("quantization_config", None)
        if quantization is not None:
            settings["quantization_config"] = quantization
        (directory / "config.json").write_text(json.dumps(settings))


# ---- AutoAWQ GEMM -------------------------------------------------------------------------------
def awq_pack(weight: torch.Tensor, group_size: int) -> Parts:
    """WQLinear_GEMM.from_linear: zero-point quantization per group, columns packed 8 per
    int32 in AWQ's interleaved order."""
    n, k = weight.shape
    groups = weight.reshape(n, -1, group_size)
    high, low = groups.amax(-1), groups.amin(-1)
    scales = ((high - low).clamp(min=1e-5) / 15).to(torch.float16)  # [N, G]
    zeros = torch.clamp(-torch.round(low / scales.float()), 0, 15).to(torch.int32)
    g = torch.arange(k) // group_size
    intweight = torch.clamp(torch.round(weight / scales.float()[:, g]) + zeros[:, g], 0, 15)
    intweight = intweight.to(torch.int32).t().contiguous()  # [K, N]
    return {
        "qweight": _awq_words(intweight),
        "qzeros": _awq_words(zeros.t().contiguous()),
        "scales": scales.t().contiguous(),
    }


def _awq_words(values: torch.Tensor) -> torch.Tensor:
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return packed


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's unpack: shift out 8 nibbles per word, then undo the order with its reverse."""
    shifts = torch.arange(0, 32, 4)
    raw = (packed[:, :, None] >> shifts[None, None, :]).reshape(packed.shape[0], -1) & 0xF
    order = torch.arange(raw.shape[1]).reshape(-1, 8)[:, AWQ_REVERSE_ORDER].reshape(-1)
    return raw[:, order]


def awq_dequant(parts: Parts, group_size: int) -> torch.Tensor:
    iweight, izeros = _awq_unpack(parts["qweight"]), _awq_unpack(parts["qzeros"])  # [K, N], [G, N]
    g = torch.arange(iweight.shape[0]) // group_size
    scales = parts["scales"].float()
    return ((iweight - izeros[g]).float() * scales[g]).t()


def awq_config(group_size: int) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}  # fmt: skip


# ---- AutoGPTQ (v1 checkpoint format) ------------------------------------------------------------
def gptq_pack(
    weight: torch.Tensor, group_size: int, symmetric: bool, act_order: bool, seed: int = 0
) -> Parts:
    """QuantLinear.pack: groups over the act-order permutation (g_idx), qweight packed along
    the input, qzeros holding z - 1."""
    n, k = weight.shape
    num_groups = k // group_size
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else None
    g_idx = torch.arange(k, dtype=torch.int32) // group_size
    if perm is not None:
        g_idx[perm] = torch.arange(k, dtype=torch.int32) // group_size
    scales = torch.empty(n, num_groups)
    zeros = torch.empty(n, num_groups, dtype=torch.int32)
    for group in range(num_groups):
        cols = weight[:, g_idx == group]
        high, low = cols.amax(1).clamp(min=0), cols.amin(1).clamp(max=0)
        if symmetric:
            high = torch.maximum(high, -low)
            scales[:, group], zeros[:, group] = 2 * high.clamp(min=1e-5) / 15, 8
        else:
            scales[:, group] = (high - low).clamp(min=1e-5) / 15
            zeros[:, group] = torch.round(-low / scales[:, group])
    scales = scales.to(torch.float16)
    gi = g_idx.long()
    intweight = torch.clamp(torch.round(weight / scales.float()[:, gi]) + zeros[:, gi], 0, 15)
    intweight = intweight.to(torch.int32).t().contiguous()  # [K, N]
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    for row in range(k // 8):
        for j in range(8):
            qweight[row] |= intweight[row * 8 + j] << (4 * j)
    stored = (zeros - 1).t().contiguous()  # [G, N]
    qzeros = torch.zeros(num_groups, n // 8, dtype=torch.int32)
    for col in range(n // 8):
        for j in range(8):
            qzeros[:, col] |= (stored[:, col * 8 + j] & 0xF) << (4 * j)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.t().contiguous(),
            "g_idx": g_idx}  # fmt: skip


def gptq_dequant(parts: Parts) -> torch.Tensor:
    """The forward of AutoGPTQ's QuantLinear: zeros + 1, then per input row its group's."""
    qweight, qzeros, scales, g_idx = (parts[p] for p in ("qweight", "qzeros", "scales", "g_idx"))
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    shifts = torch.arange(0, 32, 4)
    weight = ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(k, n)
    zeros = ((qzeros[:, :, None] >> shifts[None, None, :]) & 0xF).reshape(qzeros.shape[0], -1)
    zeros = zeros + 1
    gi = g_idx.long()
    return (scales.float()[gi] * (weight - zeros[gi]).float()).t()


def gptq_config(group_size: int, symmetric: bool, act_order: bool) -> dict[str, Any]:
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
            "sym": symmetric, "damp_percent": 0.01, "true_sequential": True,
            "static_groups": False, "model_name_or_path": None,
            "model_file_base_name": None, "checkpoint_format": "gptq"}  # fmt: skip


# ---- whole checkpoints --------------------------------------------------------------------------
Producer = tuple[Callable[[torch.Tensor], Parts], Callable[[Parts], torch.Tensor], dict[str, Any]]


def producer(name: str, group_size: int = 32) -> Producer:
    """(quantize one weight, the producer's dequantization, quantization_config) by name."""
    if name == "deepseek-fp8":
        return deepseek_fp8, deepseek_dequant, FP8_CONFIG
    if name in ("ct-mxfp4", "ct-nvfp4"):
        fp4_kind = name.removeprefix("ct-")
        fmt = f"{fp4_kind}-pack-quantized"
        return (
            (lambda w: ct_fp4_compress(w, fp4_kind)),
            (lambda p: ct_fp4_dequant(p, fp4_kind)),
            ct_config(ct_fp4_scheme(fp4_kind), fmt),
        )
    if name == "modelopt-nvfp4":
        return modelopt_nvfp4, modelopt_dequant, MODELOPT_CONFIG
    if name.startswith("ct-"):
        kind, _, sym = name.removeprefix("ct-").partition("-")
        scheme = ct_scheme(kind, group_size, symmetric=sym != "asym")
        fmt = "pack-quantized" if kind == "int4" else "float-quantized"
        return (
            (lambda w: ct_compress(w, scheme)),
            (lambda p: ct_dequant(p, scheme)),
            (ct_config(scheme, fmt)),
        )
    if name == "awq":
        return (
            (lambda w: awq_pack(w, group_size)),
            (lambda p: awq_dequant(p, group_size)),
            (awq_config(group_size)),
        )
    symmetric, act_order = "asym" not in name, "act" in name
    return (
        lambda w: gptq_pack(w, group_size, symmetric, act_order),
        gptq_dequant,
        gptq_config(group_size, symmetric, act_order),
    )


def write_shipped(src: Path, out: Path, ref: Path, name: str, group_size: int = 32) -> Path:
    """Rewrite the dense checkpoint `src` as producer `name` writes it (into `out`), and the
    producer's own dequantization of it as a float32 checkpoint (into `ref`, for transformers)."""
    from safetensors.torch import load_file, save_file

    quantize, dequantize, config = producer(name, group_size)
    stored, reference = {}, {}
    for tensor_name, tensor in load_file(str(src / "model.safetensors")).items():
        if not QUANTIZED.search(tensor_name):
            stored[tensor_name] = reference[tensor_name] = tensor
            continue
        module = tensor_name.removesuffix(".weight")
        parts = quantize(tensor.float())
        stored.update({f"{module}.{part}": value for part, value in parts.items()})
        reference[tensor_name] = dequantize(parts).float()
    for directory, tensors, quantization in ((out, stored, config), (ref, reference, None)):
        shutil.copytree(src, directory, dirs_exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  str(directory / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
        settings = json.loads((directory / "config.json").read_text())
        settings.pop("quantization_config", None)
        if quantization is not None:
            settings["quantization_config"] = quantization
        (directory / "config.json").write_text(json.dumps(settings))
    return out
