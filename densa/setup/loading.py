"""What an engine loads besides its main weights: the tokenizer, a decode-phase weight set
(phase-aware formats), and static FP8 KV scales; each checked against the model first."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from densa.config import CacheConfig, ModelConfig
from densa.formats import fp8_kv
from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.interface import CausalLM
from densa.model.linear import resident_weight_bytes
from densa.model.loader import LoadPlan, load_planned, plan_load, resolve_model_dir
from densa.text.tokenizer import Tokenizer, TokenizerLoadError
from densa.utils.logging import get_logger
from densa.utils.sizes import format_bytes

logger = get_logger(__name__)


def load_tokenizer(model_dir: Path, eos_token_ids: tuple[int, ...]) -> Tokenizer:
    try:
        return Tokenizer.from_dir(model_dir, eos_token_ids)
    except (TokenizerLoadError, OSError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc


@dataclass(frozen=True)
class ModelLoads:
    """The weight loads an engine makes, planned once: the memory check measures them, then
    they load (`load_models`)."""

    model: LoadPlan
    decode_model: LoadPlan | None = None  # phase-aware formats: the decode-phase weight set


def plan_loads(
    config: ModelConfig, model_dir: Path, arch: ArchConfig, device: torch.device
) -> ModelLoads:
    """The model's load, and the decode-phase weight set's where the formats are phase-aware.

    The decode set must be the same model (same shapes): its layers write into and read from
    the same KV cache as the prefill weights'. Costs its resident weight bytes on top of the
    prefill set's."""
    dtype, max_len, head = config.dtype, config.max_model_len, config.head_format
    model = plan_load(model_dir, arch, dtype, max_len, device, config.weight_format, head)
    if config.decode_weight_format is not None:
        fmt = config.decode_weight_format
        return ModelLoads(model, plan_load(model_dir, arch, dtype, max_len, device, fmt, head))
    if config.decode_model is None:
        return ModelLoads(model)
    decode_dir = resolve_model_dir(config.decode_model)
    decode_arch = ArchConfig.from_dir(decode_dir)
    if not same_shapes(arch, decode_arch):
        raise ModelLoadError(
            f"--decode-model {config.decode_model} is not the same model as --model "
            "(its layer shapes differ); it must be a checkpoint of the same weights"
        )
    decode = plan_load(decode_dir, decode_arch, dtype, max_len, device, "auto", head)
    return ModelLoads(model, decode)


def load_models(loads: ModelLoads) -> tuple[CausalLM, CausalLM | None]:
    """The planned weight sets, loaded: the model, and the decode-phase set (or None)."""
    model = load_planned(loads.model)
    if loads.decode_model is None:
        return model, None
    decode_model = load_planned(loads.decode_model)
    logger.info(
        "phase-aware weights: decode runs through %s weights of %s (%s more resident memory)",
        decode_model.weight_format, loads.decode_model.model_dir.name,
        format_bytes(resident_weight_bytes(decode_model)),
    )  # fmt: skip
    return model, decode_model


def same_shapes(a: ArchConfig, b: ArchConfig) -> bool:
    """Whether two checkpoints can share one KV cache and one tokenizer."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings")  # fmt: skip
    return all(getattr(a, key) == getattr(b, key) for key in keys)


def load_static_kv_scales(
    cache: CacheConfig, kv_format: KVFormat, arch: ArchConfig, device: torch.device
) -> fp8_kv.KVScales | None:
    """Check an FP8 KV cache can run here; the static scales it uses (None: not needed).

    Raises ModelLoadError naming the alternative when this build cannot run FP8, and when the
    scales file does not fit the model. Options that do not fit together raise ValueError.
    """
    if not kv_format.is_fp8:
        return None
    problem = fp8_kv.fp8_support_error(device)
    if problem is not None:
        raise ModelLoadError(problem)
    if cache.kv_scales_file is not None and not kv_format.has_layer_scales:
        raise ValueError("a KV scales file holds static per-layer scales: use --kv-scales static")
    if not kv_format.has_layer_scales:
        return None
    if cache.kv_scales_file is None:
        return fp8_kv.KVScales.ones(arch.num_layers)
    try:
        return fp8_kv.KVScales.load(cache.kv_scales_file, arch.num_layers)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
