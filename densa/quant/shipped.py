"""Checkpoints quantized by other producers, read as shipped: their `quantization_config`
(config.json, parsed by densa.quant.shipped_config) becomes a densa `CheckpointFormat` whose
`producer` names the layout, and each quantized weight's tensors are converted into densa's
runtime parts as they are read (densa.quant.shipped_layouts; no dense copy of the model is made).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from densa.formats.fp8_blocks import dequantize_fp8
from densa.formats.int4 import dequantize_int4
from densa.quant import shipped_layouts as layouts
from densa.quant.shipped_config import ShippedSpec, UnsupportedCheckpoint, parse_quantization_config
from densa.quant.weight_format import CheckpointFormat, StoredTensor, WeightFormat

Parts = dict[str, torch.Tensor]
Header = dict[str, tuple[tuple[int, ...], str]]  # tensor name -> (shape, safetensors dtype)


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


# ---- which tensors are quantized ----------------------------------------------------------------
def shipped_format(
    spec: ShippedSpec, header: Header, read: Callable[[str], torch.Tensor]
) -> CheckpointFormat:
    """List every quantized weight: a module with the spec's marker tensor. Its optional parts
    (g_idx, a bias-free layer's zero point) are taken where present; act-order layers whose
    g_idx is not k // group are listed in `dense` (dequantized when loaded)."""
    ckpt = CheckpointFormat(format=spec.fmt, producer=spec.producer)
    dense = set()
    sep = spec.separator
    for file_name in header:
        if not file_name.endswith(sep + spec.marker):
            continue
        module = file_name.removesuffix(sep + spec.marker)
        names = {p: f"{module}{sep}{s}" for p, s in spec.parts.items()}
        parts = {p: name for p, name in names.items() if name in header}
        missing = sorted(set(spec.parts) - set(parts) - spec.optional)
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


def _logical_shape(spec: ShippedSpec, header: Header, parts: dict[str, str]) -> tuple[int, ...]:
    """[out, in] (gpt-oss: [experts, out, in]) of a quantized weight from its stored tensors'
    shapes."""
    if spec.producer == "mxfp4-blocks":  # [..., N, K/32, 16]
        *rows, groups, pairs = header[parts["blocks"]][0]
        return (*(int(d) for d in rows), int(groups * pairs * 2))
    if spec.fmt.is_fp4:  # packed [N, K/2]
        out_features, half = header[parts["packed"]][0]
        return int(out_features), int(2 * half)
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
        if self.fmt.is_fp4:
            return layouts.fp4_runtime(self.producer, parts)
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
        if self.fmt.is_fp4:
            return layouts.dequantize_fp4(self.producer, parts)
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
    keep = runtime is not None and runtime.stored_as() == ckpt.format.stored_as()
    for name, value in grouped:
        if not isinstance(value, Quantized):
            yield name, value
        elif keep and name not in dense:
            yield name, Converted(quantizer.to_runtime(value.parts, value.shape))
        else:
            yield name, quantizer.dequantize(value.parts, value.shape)
