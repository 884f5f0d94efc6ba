"""Checkpoints quantized by other producers, read as shipped: their `quantization_config`
(config.json) becomes a densa `CheckpointFormat` whose `producer` names the layout, and each
quantized weight's tensors are converted into densa's runtime parts as they are read
(densa.quant.shipped_layouts; no dense copy of the model is made).

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
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from densa.formats.fp8_blocks import dequantize_fp8
from densa.formats.int4 import dequantize_int4
from densa.quant import shipped_layouts as layouts
from densa.quant.weight_format import CheckpointFormat, StoredTensor, WeightFormat

Parts = dict[str, torch.Tensor]
Header = dict[str, tuple[tuple[int, ...], str]]  # tensor name -> (shape, safetensors dtype)


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


@dataclass(frozen=True)
class ShippedSpec:
    """What `parse_quantization_config` found: the producer's layout, densa's format for it, and
    which file tensors (by suffix of '<module>.') make up one quantized weight."""

    producer: str
    fmt: WeightFormat
    marker: str  # the part whose presence marks a quantized weight
    parts: dict[str, str]  # densa part name -> suffix in the file ('weight_scale_inv', ...)
    act_order: bool = False  # g_idx may reorder groups: read it to find the layers that do


def read_shipped_format(model_dir: Path, files: list[Path]) -> CheckpointFormat | None:
    """The checkpoint's quantization as a CheckpointFormat (None for dense checkpoints and for
    densa's own, which carry their format in the safetensors metadata)."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text()).get("quantization_config")
    if not config or config.get("quant_method") == "densa":
        return None
    header = _headers(files)
    spec = parse_quantization_config(config, _scale_dtype(header, config))
    return shipped_format(spec, header, lambda name: _read_tensor(files, name))


def parse_quantization_config(config: dict[str, Any], scale_dtype: str) -> ShippedSpec:
    """`quantization_config` -> ShippedSpec; `scale_dtype` is the dtype the checkpoint stores
    its INT4 scales in (kept when a symmetric format holds them exactly)."""
    method = config.get("quant_method")
    parsers: dict[str, Callable[[dict[str, Any], str], ShippedSpec]] = {
        "fp8": _parse_fp8,
        "compressed-tensors": _parse_compressed,
        "awq": _parse_awq,
        "gptq": _parse_gptq,
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
    raise UnsupportedCheckpoint(
        f"compressed-tensors format {fmt_name!r} is not supported "
        "(densa reads float-quantized FP8 and pack-quantized INT4)"
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


# ---- which tensors are quantized ----------------------------------------------------------------
def shipped_format(
    spec: ShippedSpec, header: Header, read: Callable[[str], torch.Tensor]
) -> CheckpointFormat:
    """List every quantized weight: a module with the spec's marker tensor. Its optional parts
    (g_idx, a bias-free layer's zero point) are taken where present; act-order layers whose
    g_idx is not k // group are listed in `dense` (dequantized when loaded)."""
    ckpt = CheckpointFormat(format=spec.fmt, producer=spec.producer)
    dense = set()
    for file_name in header:
        module, _, suffix = file_name.rpartition(".")
        if suffix != spec.marker:
            continue
        parts = {p: f"{module}.{s}" for p, s in spec.parts.items() if f"{module}.{s}" in header}
        missing = sorted(set(spec.parts) - set(parts) - {"g_idx"})
        if missing:
            raise UnsupportedCheckpoint(f"{module} lacks its {missing} tensors")
        logical = f"{module}.weight"
        ckpt.tensors[logical] = StoredTensor(_logical_shape(spec, header, parts), parts)
        g_idx = parts.get("g_idx")
        if g_idx is None or not spec.act_order:
            continue
        if not layouts.is_contiguous_groups(read(g_idx), spec.fmt.group_size):
            dense.add(logical)
    ckpt.dense = frozenset(dense)
    return ckpt


def _logical_shape(spec: ShippedSpec, header: Header, parts: dict[str, str]) -> tuple[int, int]:
    """[out, in] of a quantized weight from its stored tensors' shapes."""
    if spec.producer.startswith("fp8"):
        out_features, in_features = header[parts["weight"]][0]
    elif spec.producer == "ct-int4":
        out_features = header[parts["packed"]][0][0]
        in_features = header[parts["scale"]][0][1] * spec.fmt.group_size
    else:  # awq: qweight [K, N/8]; gptq: qweight [K/8, N]
        in_features, out_features = header[parts["qweight"]][0]
        if spec.producer == "awq":
            out_features *= 8
        else:
            in_features *= 8
    return int(out_features), int(in_features)


def _headers(files: list[Path]) -> Header:
    from safetensors import safe_open

    header: Header = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                view = handle.get_slice(name)
                header[name] = (tuple(view.get_shape()), view.get_dtype())
    return header


def _read_tensor(files: list[Path], name: str) -> torch.Tensor:
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            if name in handle.keys():  # noqa: SIM118
                return handle.get_tensor(name)
    raise KeyError(name)


_SCALE_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_SCALE_TENSOR = re.compile(r"\.(weight_scale|scales)$")


def _scale_dtype(header: Header, config: dict[str, Any]) -> str:
    """The dtype of the first INT4 scale tensor in the files (float32 if none or unusual)."""
    if config.get("quant_method") == "fp8":
        return "float32"
    for name, (_, dtype) in header.items():
        if _SCALE_TENSOR.search(name):
            return _SCALE_DTYPES.get(dtype, "float32")
    return "float32"


# ---- converting one weight ----------------------------------------------------------------------
class ShippedQuantizer:
    """Converts one shipped weight's parts (named as ShippedSpec.parts) into densa's runtime parts
    for `fmt`, or dequantizes them (float32, exact)."""

    def __init__(self, producer: str, fmt: WeightFormat) -> None:
        self.producer, self.fmt = producer, fmt

    def to_runtime(self, parts: Parts, shape: tuple[int, ...]) -> Parts:
        if self.producer == "fp8-block":
            return layouts.fp8_block_runtime(parts["weight"], parts["scale"], self.fmt.block_size)
        if self.producer == "fp8-channel":
            return layouts.fp8_channel_runtime(parts["weight"], parts["scale"], self.fmt.block_size)
        codes, scales, zero_codes, _ = self._int4(parts, shape)
        if self.fmt.symmetric:
            if not bool((zero_codes == layouts.CODE_OFFSET).all()):
                raise UnsupportedCheckpoint(
                    "a symmetric GPTQ checkpoint stores zero points other than 8"
                )
            return layouts.int4_runtime(codes, scales, None, self.fmt.torch_scale_dtype)
        return layouts.int4_runtime(codes, scales, zero_codes, self.fmt.torch_scale_dtype)

    def dequantize(self, parts: Parts, shape: tuple[int, ...]) -> torch.Tensor:
        if self.producer.startswith("fp8"):
            runtime = self.to_runtime(parts, shape)
            return dequantize_fp8(runtime["weight"], runtime["weight_scale"], self.fmt.block_size)
        codes, scales, zero_codes, g_idx = self._int4(parts, shape)
        if g_idx is None:
            runtime = layouts.int4_runtime(codes, scales, zero_codes, torch.float32)
            return dequantize_int4(runtime["qweight"], runtime["scales"], runtime["zeros"],
                                   self.fmt.group_size, shape[1])  # fmt: skip
        return layouts.dequantize_int_groups(codes, scales, zero_codes, g_idx)

    def _int4(
        self, parts: Parts, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """codes [N, K], scales [N, G], integer zero points [N, G] and, for act-order layers,
        each input's group [K] (None when groups are contiguous)."""
        out_features, in_features = shape
        g = self.fmt.group_size
        g_idx = parts.get("g_idx")
        if g_idx is not None and layouts.is_contiguous_groups(g_idx, g):
            g_idx = None
        if self.producer == "ct-int4":
            codes = layouts.compressed_int4_codes(parts["packed"], in_features)
            scales = parts["scale"]
            zero = parts.get("zero")
            if zero is None:
                zero_codes = torch.full(scales.shape, layouts.CODE_OFFSET, dtype=torch.int32)
            else:
                zero_codes = layouts.compressed_int4_zero_codes(zero, out_features)
            return codes, scales, zero_codes, g_idx
        if self.producer == "awq":
            codes = layouts.awq_codes(parts["qweight"]).t()
            zero_codes = layouts.awq_codes(parts["qzeros"]).t()[:out_features]
            return codes, parts["scales"].t(), zero_codes, None
        codes = layouts.gptq_codes(parts["qweight"])
        zero_codes = layouts.gptq_zero_codes(parts["qzeros"], out_features, self.producer == "gptq")
        return codes, parts["scales"].t(), zero_codes, g_idx


def convert_shipped(
    grouped: Iterator[tuple[str, Any]],
    ckpt: CheckpointFormat,
    runtime: WeightFormat | None,
    dense: set[str],
) -> Iterator[tuple[str, Any]]:
    """Grouped shipped weights -> densa runtime parts (`Converted`) where they run in `runtime`
    (the checkpoint's format), float32 weights for the names in `dense` and when `runtime` is
    None (a dense load, or `densa quantize` dequantizing its source)."""
    from densa.quant.checkpoint import Converted, Quantized

    quantizer = ShippedQuantizer(ckpt.producer, ckpt.format)
    keep = runtime == ckpt.format
    for name, value in grouped:
        if not isinstance(value, Quantized):
            yield name, value
        elif keep and name not in dense:
            yield name, Converted(quantizer.to_runtime(value.parts, value.shape))
        else:
            yield name, quantizer.dequantize(value.parts, value.shape)
