"""From stored weights to the format the linear layers run in: which runtime format a load
asks for, which modules it quantizes, and the stream of tensors the model's parameters take
(quantized parts, dequantized weights, or dense weights quantized on the way)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace

import torch

from densa.model.arch import ModelLoadError
from densa.model.interface import CausalLM
from densa.model.linear import quantize_linears
from densa.model.quant_targets import QuantScope, quantization_targets
from densa.model.stacked_linear import StackedLinear, quantize_stacked
from densa.quant.checkpoint import Converted, Quantized, group_parts
from densa.quant.linear_format import LinearFormat
from densa.quant.quantizer import make_quantizer
from densa.quant.shipped import convert_shipped
from densa.quant.weight_format import CheckpointFormat, WeightFormat


def runtime_format(
    stored: CheckpointFormat | None, weight_format: LinearFormat
) -> WeightFormat | None:
    """The format the linear layers run from (None = dense), given what the checkpoint stores.
    Packed formats and a GGUF's own blocks load the rest of the checkpoint dense (packed
    afterwards, or kept dense)."""
    if weight_format.loads_dense_first:
        return None
    if weight_format.is_auto:
        if stored is not None and stored.format.is_fp4:  # the int8 kernels (weights.md, FP4)
            return replace(stored.format, activations="int8")
        return stored.format if stored is not None else None
    asked = weight_format.on_the_fly
    assert asked is not None  # every choice that neither loads dense first nor is auto
    if stored is None:
        return asked
    if asked.is_fp4 and stored.format.kind == asked.kind:  # how FP4 weights run: the choice
        return replace(stored.format, activations=asked.activations)
    if stored.format.kind != asked.kind:
        raise ModelLoadError(
            f"the checkpoint stores {stored.format.describe()} weights, not {weight_format}; "
            "use --weight-format auto (or dense), or re-quantize it with densa quantize"
        )
    return stored.format


def quantizable_linears(model: CausalLM, include_head: bool = False) -> set[str]:
    """Names of the modules a quantized format replaces by default (densa.model.quant_targets):
    linear and stacked expert layers, but not the output head (unless asked), routers, or
    weights tied to an embedding."""
    return quantization_targets(model, QuantScope(include_head=include_head))


def swap_quantized(model: CausalLM, targets: set[str], fmt: WeightFormat) -> None:
    """Replace the `targets` modules (on the meta device) by their quantized form in `fmt`."""
    stacked = {n for n in targets if isinstance(model.get_submodule(n), StackedLinear)}
    quantize_linears(model, targets - stacked, fmt)
    quantize_stacked(model, stacked, fmt)


def linear_module_of(model: CausalLM, hf_name: str) -> str | None:
    """The module a checkpoint weight loads into, if it is the `.weight` of a linear layer."""
    module, _, param = model.checkpoint_target(hf_name).rpartition(".")
    return module if param == "weight" else None


def runtime_tensors(
    raw: Iterator[tuple[str, torch.Tensor]],
    model: CausalLM,
    stored: CheckpointFormat | None,
    runtime: WeightFormat | None,
    targets: set[str],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors -> the tensors the model's parameters take, in HF naming: quantized
    weights become their runtime parts ('<module>.<part>'), or dense weights when dequantizing,
    and dense weights of quantized layers are quantized on the way (round-to-nearest). A shipped
    checkpoint's weights are converted one at a time as they are read (densa.quant.shipped)."""
    grouped = group_parts(raw, stored)
    shipped = stored is not None and stored.producer != "densa"
    if shipped:
        assert stored is not None
        dense = shipped_dense_names(model, stored, targets)
        grouped = convert_shipped(grouped, stored, runtime, dense)
    stored_quantizer = make_quantizer(stored.format) if stored is not None and not shipped else None
    runtime_quantizer = make_quantizer(runtime) if runtime is not None else None
    for name, value in model.normalize_checkpoint(grouped):
        if isinstance(value, Converted):
            yield from _parts_of(name, value.parts)
        elif isinstance(value, Quantized):
            assert stored_quantizer is not None  # group_parts only makes these from metadata
            if runtime_quantizer is None:
                yield name, stored_quantizer.dequantize(value.parts, value.shape[-1])
            else:
                yield from _parts_of(name, runtime_quantizer.to_runtime(value.parts))
        elif runtime_quantizer is not None and linear_module_of(model, name) in targets:
            parts = runtime_quantizer.to_runtime(runtime_quantizer.quantize(value))
            yield from _parts_of(name, parts)
        else:
            yield name, value


def _parts_of(
    weight_name: str, parts: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """'x.q_proj.weight', {qweight, scales} -> ('x.q_proj.qweight', ..), ('x.q_proj.scales', ..)."""
    module = weight_name.rpartition(".")[0]
    for part, tensor in parts.items():
        yield f"{module}.{part}", tensor


def quantized_modules(
    model: CausalLM, stored: CheckpointFormat | None, runtime: WeightFormat | None
) -> set[str]:
    """The modules that run in the quantized format `runtime` (none when it is dense)."""
    if runtime is None:
        return set()
    if stored is None:  # quantizing a dense checkpoint at load time
        return quantizable_linears(model)
    if stored.producer != "densa":
        return _shipped_modules(model, stored, runtime)
    modules = {linear_module_of(model, name) for name in stored.tensors}
    if None in modules:
        raise ModelLoadError("the checkpoint lists a quantized tensor that is not a linear weight")
    return {m for m in modules if m is not None}


def _shipped_modules(model: CausalLM, stored: CheckpointFormat, runtime: WeightFormat) -> set[str]:
    """The layers that run quantized from a shipped checkpoint (`runtime` is its format:
    runtime_format refuses another): those it stores quantized that densa quantizes too (not
    MLA's kv_b_proj, routers, ...) and holds exactly."""
    modules = {shipped_module(model, name) for name in stored.tensors}
    # A fused layer (q|k|v) with one act-order shard loads dense as a whole.
    reordered = {shipped_module(model, name) for name in stored.dense}
    return {m for m in modules - reordered if m is not None} & quantizable_linears(model)


_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def shipped_module(model: CausalLM, name: str) -> str | None:
    """The module a shipped per-tensor name loads into ('...experts.3.w1.weight' ->
    '...experts.gate_up_proj'): the family's renames, then the expert index dropped as
    stacking does."""
    renamed = next(iter(model.normalize_checkpoint(iter([(name, None)]))), None)
    if renamed is None:
        return None  # dropped by the family (DeepSeek's multi-token-prediction layers)
    return linear_module_of(model, _EXPERT_INDEX.sub(".experts.", renamed[0]))


def shipped_dense_names(model: CausalLM, stored: CheckpointFormat, targets: set[str]) -> set[str]:
    """Shipped quantized weights that load dense: act-order layers, and layers densa keeps in
    high precision (their values are the producer's dequantization, exact in float32)."""
    return {name for name in stored.tensors if shipped_module(model, name) not in targets}
