"""Quantized weights as other producers ship them, converted to densa's runtime parts exactly.

Each function takes one weight's tensors as read from the file and returns the parts densa's
layers run from (densa.kernels.cpu.int4_linear, densa.kernels.cpu.fp8_linear), without rounding a
value.
What each producer stores, and what densa makes of it:

- DeepSeek-V3 FP8 (`quant_method` fp8, weight_block_size [128, 128]): weight e4m3 [N, K],
  weight_scale_inv fp32 [N/128, K/128], w = q * s per block. densa: FP8, the block scale
  repeated per row.
- compressed-tensors float-quantized (channel / tensor / block): weight e4m3, weight_scale
  [N, 1], [1] or [N/B, K/B], w = q * s. densa: FP8, each row's scale repeated per block.
- compressed-tensors pack-quantized INT4 (group g): weight_packed int32 [N, K/8], element i at
  bits 4i stored as q + 8 (so the nibble is densa's code); weight_scale [N, K/g];
  weight_zero_point int32 [N/8, K/g] packed along N (asymmetric), w = (q - zp) s.
- AutoAWQ GEMM: qweight int32 [K, N/8], nibble i of a word = column 8c + [0,2,4,6,1,3,5,7][i];
  qzeros packed the same [K/g, N/8]; scales fp16 [K/g, N]; w = (q - z) s.
- GPTQ (AutoGPTQ): qweight int32 [K/8, N], nibble j = input 8r + j; qzeros [G, N/8] hold
  z - 1 in v1 checkpoints (z in v2); scales fp16 [G, N]; g_idx [K]; w = (q - z[g]) s[g].

densa's INT4 is w = (c - 8) * scale + zero with contiguous groups, so an integer zero point z
becomes the float zero (8 - z) * s: exact in float32 (a 4-bit integer times a 16-bit scale),
not in a 16-bit dtype, which is why asymmetric formats load with float32 scales and zeros.
Act-order (g_idx not k // g) has no contiguous groups: such layers are dequantized instead.

FP4 (densa.formats.fp4): every producer stores the e2m1 codes two per byte, the even column in
the low nibble, so the codes load as they are:
- gpt-oss MXFP4: `<param>_blocks` uint8 [E, N, K/32, 16] (the [E, N, K/2] codes, grouped),
  `<param>_scales` uint8 [E, N, K/32] E8M0.
- compressed-tensors mxfp4: weight_packed [N, K/2], weight_scale uint8 E8M0 [N, K/32].
- compressed-tensors nvfp4: weight_packed, weight_scale e4m3 [N, K/16], weight_global_scale
  [1]: w = q * (s / g). densa keeps 1 / g per row (its kernels multiply); the exact
  dequantization here divides, as compressed-tensors does.
- ModelOpt NVFP4: weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 [] float32:
  w = q * (s * s2).
Activation scales (input_scale, input_global_scale) are read and dropped (shipped_config).
"""

from __future__ import annotations

import torch

from densa.formats import fp4
from densa.formats.fp8_blocks import expand_block_scales
from densa.formats.int4 import CODE_OFFSET, pack_nibbles

Parts = dict[str, torch.Tensor]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
_NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int32_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., W] int32 -> [..., W, 8] codes 0..15, element i from bits 4i..4i+3."""
    return (packed.unsqueeze(-1) >> _NIBBLE_SHIFTS) & 0xF


# ---- FP8 ----------------------------------------------------------------------------------------
def fp8_block_runtime(weight: torch.Tensor, block_scales: torch.Tensor, block: int) -> Parts:
    """e4m3 [N, K] with [ceil(N/B), ceil(K/B)] block scales (DeepSeek's weight_scale_inv,
    compressed-tensors' block strategy) -> densa's FP8 runtime parts."""
    _check_fp8(weight)
    return {
        "weight": weight,
        "weight_scale": expand_block_scales(block_scales.float(), weight.shape[0], block),
    }


def fp8_channel_runtime(weight: torch.Tensor, scale: torch.Tensor, block: int) -> Parts:
    """e4m3 [N, K] with one scale per output channel ([N, 1]) or per tensor ([1]) -> densa's
    FP8 runtime parts: the scale repeated over each row's column blocks."""
    _check_fp8(weight)
    out_features, in_features = weight.shape
    num_blocks = -(-in_features // block)
    rows = scale.float().reshape(-1, 1).expand(out_features, num_blocks)
    return {"weight": weight, "weight_scale": rows.contiguous()}


def _check_fp8(weight: torch.Tensor) -> None:
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"an FP8 weight must be float8_e4m3fn, found {weight.dtype}")


# ---- INT4 ---------------------------------------------------------------------------------------
def int4_runtime(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zero_codes: torch.Tensor | None,
    fmt_dtype: torch.dtype,
) -> Parts:
    """codes [N, K] in 0..15, scales [N, G], integer zero points [N, G] (None: 8, symmetric) ->
    densa's INT4 parts: w = (c - 8) s + zero with zero = (8 - z) s, exact in float32."""
    parts = {"qweight": pack_nibbles(codes.to(torch.uint8))}
    if zero_codes is None:
        parts["scales"] = scales.to(fmt_dtype).contiguous()
        return parts
    scale32 = scales.float()
    parts["scales"] = scale32.contiguous()
    parts["zeros"] = ((CODE_OFFSET - zero_codes.float()) * scale32).contiguous()
    return parts


def compressed_int4_codes(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """compressed-tensors' weight_packed [N, ceil(K/8)] int32 -> codes [N, K] (q + 8)."""
    return unpack_int32_nibbles(packed).reshape(packed.shape[0], -1)[:, :in_features]


def compressed_int4_zero_codes(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """weight_zero_point packed along the output dimension [ceil(N/8), G] -> [N, G] (zp + 8)."""
    nibbles = unpack_int32_nibbles(packed)  # [N/8, G, 8]: row 8r + i in nibble i
    return nibbles.permute(0, 2, 1).reshape(-1, packed.shape[1])[:out_features]


def awq_codes(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM qweight / qzeros [R, N/8] int32 -> [R, N] in column order."""
    nibbles = unpack_int32_nibbles(packed)  # [R, N/8, 8]: nibble i = column 8c + AWQ_ORDER[i]
    columns = torch.empty_like(nibbles)
    columns[..., list(AWQ_ORDER)] = nibbles
    return columns.reshape(packed.shape[0], -1)


def gptq_codes(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight [K/8, N] int32 (packed along the input) -> codes [N, K]."""
    nibbles = unpack_int32_nibbles(qweight.t())  # [N, K/8, 8]: input 8r + j in nibble j
    return nibbles.reshape(qweight.shape[1], -1)


def gptq_zero_codes(qzeros: torch.Tensor, out_features: int, v1_offset: bool) -> torch.Tensor:
    """GPTQ qzeros [G, N/8] -> integer zero points [N, G]; v1 checkpoints store z - 1."""
    zeros = unpack_int32_nibbles(qzeros).reshape(qzeros.shape[0], -1)[:, :out_features]
    if v1_offset:
        zeros = zeros + 1  # AutoGPTQ's forward adds 1 unmasked: stored 15 means 16
    return zeros.t()


def is_contiguous_groups(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether input k belongs to group k // group_size (no act-order reordering)."""
    natural = torch.arange(len(g_idx), dtype=torch.int64) // group_size
    return bool(torch.equal(g_idx.to(torch.int64), natural))


def dequantize_int_groups(
    codes: torch.Tensor, scales: torch.Tensor, zero_codes: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """codes [N, K], scales and zero points [N, G], group of each input g_idx [K] -> [N, K]
    float32 w = (q - z[g]) s[g]: exact, for layers whose groups are not contiguous."""
    groups = g_idx.to(torch.int64)
    return (codes.float() - zero_codes.float()[:, groups]) * scales.float()[:, groups]


# ---- FP4 ----------------------------------------------------------------------------------------
def fp4_runtime(producer: str, parts: Parts) -> Parts:
    """A shipped MXFP4 / NVFP4 weight's tensors -> densa's FP4 runtime parts (the codes and
    scale bytes as stored; NVFP4's tensor scale as a multiplier per row)."""
    if producer == "mxfp4-blocks":
        blocks = parts["blocks"]  # [..., N, K/32, 16]
        return {"qweight": blocks.flatten(-2).contiguous(), "scales": parts["scales"]}
    runtime = {"qweight": parts["packed"], "scales": parts["scale"].contiguous().view(torch.uint8)}
    if producer == "ct-nvfp4":
        runtime["tensor_scale"] = _per_row(1.0 / parts["global_scale"].float(), parts["packed"])
    elif producer == "modelopt-nvfp4":
        runtime["tensor_scale"] = _per_row(parts["scale_2"].float(), parts["packed"])
    return runtime


def dequantize_fp4(producer: str, parts: Parts) -> torch.Tensor:
    """The producer's own dequantization, exactly (float32): compressed-tensors divides by its
    global scale, ModelOpt multiplies by weight_scale_2."""
    if producer in ("mxfp4-blocks", "ct-mxfp4"):
        runtime = fp4_runtime(producer, parts)
        return fp4.dequantize_mxfp4(runtime["qweight"], runtime["scales"])
    scales = parts["scale"].contiguous().view(torch.uint8)
    if producer == "ct-nvfp4":
        return fp4.dequantize_nvfp4(parts["packed"], scales, parts["global_scale"], divide=True)
    return fp4.dequantize_nvfp4(parts["packed"], scales, parts["scale_2"])


def _per_row(scale: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    if scale.numel() != 1:
        raise ValueError(f"an NVFP4 tensor scale has one value, found {scale.numel()}")
    return scale.reshape(1).expand(packed.shape[0]).contiguous()
