"""What another producer's `quantization_config` (config.json) says, as a ShippedSpec: the
producer's layout, densa's format for it, and the file tensors of one quantized weight
(densa.quant.shipped reads the checkpoint with it).

Every key of a `quantization_config` is either used, checked to hold a value densa executes
exactly as the producer meant, or known to describe only how the checkpoint was made (the
calibration, the producer's kernels). Anything else is an error naming the keys: a key densa
does not understand might change what the stored numbers mean.

    producer         `quant_method`       densa format
    fp8-block        fp8 (DeepSeek-V3,    fp8 B x B blocks (B from weight_block_size)
                     Kimi K2, GLM FP8),
                     compressed-tensors
                     float-quantized block
    fp8-channel      compressed-tensors   fp8 128 x 128 layout, one scale per row repeated
                     float-quantized      over the row's blocks
                     channel / tensor
    ct-int4          compressed-tensors   int4 g32/64/128; symmetric: the checkpoint's scale
                     pack-quantized       dtype; asymmetric: float32 scales and zeros
    awq              awq (GEMM)           int4, float32 scales and zeros
    gptq, gptq-v2    gptq                 int4; symmetric (every zero point 8): fp16 scales,
                                          else float32 scales and zeros
    mxfp4-blocks     mxfp4 (gpt-oss)      mxfp4: `<name>_blocks` [.., N, K/32, 16] e2m1 pairs,
                                          `<name>_scales` [.., N, K/32] E8M0
    ct-mxfp4         compressed-tensors   mxfp4: weight_packed, weight_scale (E8M0)
                     mxfp4-pack-quantized
    ct-nvfp4         compressed-tensors   nvfp4: weight_packed, weight_scale (e4m3), divided by
                     nvfp4-pack-quantized weight_global_scale
    modelopt-nvfp4   modelopt, NVFP4      nvfp4: weight (packed), weight_scale (e4m3), times
                                          weight_scale_2
FP4 activation scales (ModelOpt's input_scale, compressed-tensors' input_global_scale) belong
to the producer's FP4 x FP4 kernels; densa's activations stay int8 per 32 inputs (CPU) or in
the compute dtype (GPU), so they are read and dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from densa.formats.fp4 import Fp4Scheme
from densa.quant.weight_format import WeightFormat


class UnsupportedCheckpoint(ValueError):
    """A quantization_config densa cannot execute exactly (the message says what to do)."""


# Keys that describe how a checkpoint was produced, not what its numbers mean.
_AWQ_INFO = {"modules_to_not_convert", "do_fuse", "fuse_max_seq_len", "backend", "exllama_config"}
_GPTQ_INFO = {
    "damp_percent", "damp_auto_increment", "true_sequential", "static_groups",
    "model_name_or_path", "model_file_base_name", "quantizer", "meta", "dataset", "tokenizer",
    "use_exllama", "exllama_config", "use_cuda_fp16", "max_input_length", "cache_block_outputs",
    "modules_in_block_to_quantize", "backend", "mse", "module_name_preceding_first_block",
    "batch_size", "pad_token_id", "use_marlin", "block_name_to_quantize",
}  # fmt: skip
_CT_INFO = {"global_compression_ratio", "version", "ignore", "quantization_status", "provider"}
_CT_ARG_INFO = {"observer", "observer_kwargs", "scale_dtype", "zp_dtype"}
_FP8_INFO = {"modules_to_not_convert"}
_MXFP4_INFO = {"modules_to_not_convert"}
_MODELOPT_INFO = {"exclude_modules", "ignore", "producer", "config_groups"}


@dataclass(frozen=True)
class ShippedSpec:
    """What `parse_quantization_config` found: the producer's layout, densa's format for it, and
    which file tensors (by suffix of '<module>.') make up one quantized weight."""

    producer: str
    fmt: WeightFormat
    marker: str  # the part whose presence marks a quantized weight
    parts: dict[str, str]  # densa part name -> suffix in the file ('weight_scale_inv', ...)
    act_order: bool = False  # g_idx may reorder groups: read it to find the layers that do
    # How a part's name follows the weight's base name: '<module>.<suffix>' for most producers,
    # '<param><suffix>' for gpt-oss ('...experts.gate_up_proj' + '_blocks').
    separator: str = "."
    optional: frozenset[str] = frozenset({"g_idx"})  # parts a weight may lack


def parse_quantization_config(config: dict[str, Any], scale_dtype: str) -> ShippedSpec:
    """`quantization_config` -> ShippedSpec; `scale_dtype` is the dtype the checkpoint stores
    its INT4 scales in (kept when a symmetric format holds them exactly)."""
    method = config.get("quant_method")
    parsers: dict[str, Callable[[dict[str, Any], str], ShippedSpec]] = {
        "fp8": _parse_fp8,
        "compressed-tensors": _parse_compressed,
        "awq": _parse_awq,
        "gptq": _parse_gptq,
        "mxfp4": _parse_mxfp4,
        "modelopt": _parse_modelopt,
    }
    if method not in parsers:
        raise UnsupportedCheckpoint(
            f"quantization_config.quant_method {method!r} is not supported; densa reads "
            f"{sorted(parsers)} (and its own `densa quantize` checkpoints)"
        )
    return parsers[str(method)](config, scale_dtype)


def _check_keys(where: str, config: dict[str, Any], used: set[str], info: set[str]) -> None:
    unknown = sorted(set(config) - used - info)
    if unknown:
        raise UnsupportedCheckpoint(
            f"{where} has keys densa does not understand: {unknown}; they may change what the "
            "stored numbers mean, so the checkpoint is refused rather than misread"
        )


def _require(where: str, key: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise UnsupportedCheckpoint(f"{where}.{key} = {value!r} is not supported (only {allowed})")


def _fp8_block_size(where: str, block: Any) -> int:
    if not (isinstance(block, list) and len(block) == 2 and block[0] == block[1] and block[0] > 0):
        raise UnsupportedCheckpoint(
            f"{where} = {block!r}: densa's FP8 format holds square blocks [B, B] only"
        )
    return int(block[0])


def _parse_fp8(config: dict[str, Any], scale_dtype: str) -> ShippedSpec:
    where = "quantization_config"
    used = {"quant_method", "fmt", "activation_scheme", "weight_block_size"}
    _check_keys(where, config, used, _FP8_INFO)
    _require(where, "fmt", config.get("fmt", "e4m3"), ["e4m3"])
    # Dynamic activation quantization is a choice of the producer's kernels; densa runs the same
    # weights with activations in the compute dtype. Static scales would be dropped: refused.
    _require(where, "activation_scheme", config.get("activation_scheme", "dynamic"), ["dynamic"])
    block = _fp8_block_size(f"{where}.weight_block_size", config.get("weight_block_size"))
    parts = {"weight": "weight", "scale": "weight_scale_inv"}
    fmt = WeightFormat("fp8", block_size=block)
    return ShippedSpec("fp8-block", fmt, "weight_scale_inv", parts)


def _parse_compressed(config: dict[str, Any], scale_dtype: str) -> ShippedSpec:
    where = "quantization_config"
    applied = ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config")
    used = {"quant_method", "format", "config_groups", *applied}
    _check_keys(where, config, used, _CT_INFO)
    for key in applied:
        if config.get(key):
            raise UnsupportedCheckpoint(f"{where}.{key} is set; densa does not apply it")
    _require(where, "quantization_status", config.get("quantization_status", "compressed"),
             ["compressed", "frozen"])  # fmt: skip
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise UnsupportedCheckpoint(
            f"{where}.config_groups has {len(groups)} groups; densa reads checkpoints with one"
        )
    name, group = next(iter(groups.items()))
    group_where = f"{where}.config_groups.{name}"
    _check_keys(group_where, group, {"targets", "weights", "input_activations",
                                     "output_activations", "format"}, set())  # fmt: skip
    fmt_name = group.get("format") or config.get("format")
    _check_activations(group_where, group)
    weights = group.get("weights") or {}
    args_where = f"{group_where}.weights"
    arg_keys = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure",
                "dynamic", "actorder"}  # fmt: skip
    _check_keys(args_where, weights, arg_keys, _CT_ARG_INFO)
    _require(args_where, "dynamic", weights.get("dynamic", False), [False])
    if fmt_name == "float-quantized":
        return _compressed_fp8(args_where, weights)
    if fmt_name == "pack-quantized":
        return _compressed_int4(args_where, weights, scale_dtype)
    scheme = Fp4Scheme.of_compressed_tensors(fmt_name)
    if scheme is not None:
        return _compressed_fp4(args_where, weights, scheme)
    raise UnsupportedCheckpoint(
        f"compressed-tensors format {fmt_name!r} is not supported (densa reads float-quantized "
        "FP8, pack-quantized INT4, mxfp4-pack-quantized and nvfp4-pack-quantized)"
    )


def _check_activations(where: str, group: dict[str, Any]) -> None:
    if group.get("output_activations"):
        raise UnsupportedCheckpoint(f"{where}.output_activations is set; densa does not apply it")
    inputs = group.get("input_activations")
    if inputs and not inputs.get("dynamic", False):
        raise UnsupportedCheckpoint(
            f"{where}.input_activations has static scales; densa runs weight-only and would "
            "drop them"
        )


def _compressed_fp8(where: str, weights: dict[str, Any]) -> ShippedSpec:
    _require(where, "type", weights.get("type"), ["float"])
    _require(where, "num_bits", weights.get("num_bits"), [8])
    strategy = weights.get("strategy")
    _require(where, "strategy", strategy, ["channel", "tensor", "block"])
    parts = {"weight": "weight", "scale": "weight_scale"}
    if strategy == "block":
        block = _fp8_block_size(f"{where}.block_structure", weights.get("block_structure"))
        fmt = WeightFormat("fp8", block_size=block)
        return ShippedSpec("fp8-block", fmt, "weight_scale", parts)
    return ShippedSpec("fp8-channel", WeightFormat("fp8", block_size=128), "weight_scale", parts)


def _compressed_int4(where: str, weights: dict[str, Any], scale_dtype: str) -> ShippedSpec:
    _require(where, "type", weights.get("type"), ["int"])
    _require(where, "num_bits", weights.get("num_bits"), [4])
    _require(where, "strategy", weights.get("strategy"), ["group"])
    _require(where, "actorder", weights.get("actorder"), [None, False, "group", "weight", "static"])
    symmetric = bool(weights.get("symmetric", True))
    fmt = _int4_format(where, weights.get("group_size"), symmetric, scale_dtype)
    parts = {"packed": "weight_packed", "scale": "weight_scale", "shape": "weight_shape"}
    if not symmetric:
        parts["zero"] = "weight_zero_point"
    act_order = weights.get("actorder") in ("group", "weight", "static")
    if act_order:
        parts["g_idx"] = "weight_g_idx"
    return ShippedSpec("ct-int4", fmt, "weight_packed", parts, act_order)


_FP4_DROPPED = frozenset({"input_scale"})  # activation scales of the producer's FP4 kernels


def _compressed_fp4(where: str, weights: dict[str, Any], scheme: Fp4Scheme) -> ShippedSpec:
    _require(where, "type", weights.get("type"), ["float"])
    _require(where, "num_bits", weights.get("num_bits"), [4])
    _require(where, "symmetric", weights.get("symmetric", True), [True])
    _require(where, "group_size", weights.get("group_size"), [scheme.group])
    _require(where, "strategy", weights.get("strategy"), [scheme.compressed_tensors_strategy])
    parts = {"packed": "weight_packed", "scale": "weight_scale"}
    if scheme.has_tensor_scale:
        parts["global_scale"] = "weight_global_scale"
    parts["input_scale"] = "input_global_scale"
    return ShippedSpec(f"ct-{scheme.name}", WeightFormat(scheme.name), "weight_packed", parts,
                       optional=_FP4_DROPPED)  # fmt: skip


def _parse_mxfp4(config: dict[str, Any], scale_dtype: str) -> ShippedSpec:
    """gpt-oss: stacked experts as `<param>_blocks` / `<param>_scales` (transformers'
    integrations/mxfp4.py reads the same tensors)."""
    _check_keys("quantization_config", config, {"quant_method"}, _MXFP4_INFO)
    parts = {"blocks": "_blocks", "scales": "_scales"}
    fmt = WeightFormat(Fp4Scheme.MXFP4.name)
    return ShippedSpec("mxfp4-blocks", fmt, "_blocks", parts, separator="")


def _parse_modelopt(config: dict[str, Any], scale_dtype: str) -> ShippedSpec:
    """NVIDIA ModelOpt's NVFP4 (config.json's quantization_config, as hf_quant_config.json's
    `quantization` section spells it)."""
    where = "quantization_config"
    used = {"quant_method", "quant_algo", "group_size", "kv_cache_quant_algo", "kv_cache_scheme"}
    _check_keys(where, config, used, _MODELOPT_INFO)
    nvfp4 = Fp4Scheme.NVFP4
    _require(where, "quant_algo", config.get("quant_algo"), [nvfp4.modelopt_algo])
    _require(where, "group_size", config.get("group_size", nvfp4.group), [nvfp4.group])
    for key in ("kv_cache_quant_algo", "kv_cache_scheme"):
        if config.get(key):
            raise UnsupportedCheckpoint(f"{where}.{key} is set; densa does not apply it")
    parts = {"packed": "weight", "scale": "weight_scale", "scale_2": "weight_scale_2",
             "input_scale": "input_scale"}  # fmt: skip
    return ShippedSpec("modelopt-nvfp4", WeightFormat(nvfp4.name), "weight_scale_2", parts,
                       optional=_FP4_DROPPED)  # fmt: skip


def _int4_format(where: str, group_size: Any, symmetric: bool, scale_dtype: str) -> WeightFormat:
    try:
        return WeightFormat("int4", group_size=int(group_size), symmetric=symmetric,
                            scale_dtype=scale_dtype if symmetric else "float32")  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise UnsupportedCheckpoint(f"{where}.group_size = {group_size!r}: {exc}") from exc


def _parse_awq(config: dict[str, Any], scale_dtype: str) -> ShippedSpec:
    where = "quantization_config"
    _check_keys(where, config, {"quant_method", "bits", "group_size", "zero_point", "version"},
                _AWQ_INFO)  # fmt: skip
    _require(where, "bits", config.get("bits"), [4])
    _require(where, "version", str(config.get("version", "gemm")).lower(), ["gemm"])
    _require(where, "zero_point", config.get("zero_point", True), [True])
    fmt = _int4_format(where, config.get("group_size"), False, "float32")
    parts = {"qweight": "qweight", "qzeros": "qzeros", "scales": "scales"}
    return ShippedSpec("awq", fmt, "qweight", parts)


def _parse_gptq(config: dict[str, Any], scale_dtype: str) -> ShippedSpec:
    where = "quantization_config"
    used = {"quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format",
            "lm_head", "pack_dtype", "format"}  # fmt: skip
    _check_keys(where, config, used, _GPTQ_INFO)
    _require(where, "bits", config.get("bits"), [4])
    _require(where, "pack_dtype", config.get("pack_dtype", "int32"), ["int32", "torch.int32"])
    version = config.get("checkpoint_format") or config.get("format") or "gptq"
    _require(where, "checkpoint_format", version, ["gptq", "gptq_v2"])
    symmetric = bool(config.get("sym", True))
    fmt = _int4_format(where, config.get("group_size"), symmetric, scale_dtype)
    parts = {"qweight": "qweight", "qzeros": "qzeros", "scales": "scales", "g_idx": "g_idx"}
    producer = "gptq" if version == "gptq" else "gptq-v2"
    return ShippedSpec(producer, fmt, "qweight", parts, bool(config.get("desc_act", False)))
