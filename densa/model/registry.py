"""Model families by the architecture name in config.json: a registry, not name sniffing.

Each entry says which model class runs the family and how it caches K/V (its KV layout). The
class decides the family's structure (norms, routing, shared experts); the numbers come from
config.json through `ArchConfig`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.deepseek_v3 import DeepseekV3ForCausalLM, KimiK25ForConditionalGeneration
from densa.model.deepseek_v32 import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
from densa.model.gemma3 import Gemma3ForCausalLM
from densa.model.gpt_oss import GptOssForCausalLM
from densa.model.interface import CausalLM
from densa.model.kv_layout import (
    DenseKVLayout,
    HybridKVLayout,
    KVLayout,
    LatentKVLayout,
    SparseLatentKVLayout,
)
from densa.model.llama import LlamaForCausalLM, Qwen3ForCausalLM
from densa.model.moe_models import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from densa.model.qwen3_next import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3NextForCausalLM,
)

ModelFactory = Callable[[ArchConfig, int, torch.device], CausalLM]


@dataclass(frozen=True)
class ModelFamily:
    model_class: ModelFactory
    kv_layout: KVLayout = field(default_factory=DenseKVLayout)


_REGISTRY: dict[str, ModelFamily] = {}


def register_model(
    architecture: str, factory: ModelFactory, kv_layout: KVLayout | None = None
) -> None:
    _REGISTRY[architecture] = ModelFamily(factory, kv_layout or DenseKVLayout())


def model_family(architecture: str) -> ModelFamily:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(_REGISTRY))
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; densa runs: {supported}"
        ) from None


def model_factory(architecture: str) -> ModelFactory:
    return model_family(architecture).model_class


def kv_layout(architecture: str) -> KVLayout:
    return model_family(architecture).kv_layout


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


# Llama's layout covers these families: Mistral is Llama with GQA (and a sliding window),
# Qwen2 adds q/k/v biases (read from the config), SmolLM2 is Llama with tied embeddings.
for _name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
    register_model(_name, LlamaForCausalLM)
register_model("Qwen3ForCausalLM", Qwen3ForCausalLM)  # + RMSNorm on each q and k head
register_model("Gemma3ForCausalLM", Gemma3ForCausalLM)
register_model("MixtralForCausalLM", MixtralForCausalLM)
register_model("Qwen2MoeForCausalLM", Qwen2MoeForCausalLM)
register_model("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM)
register_model("DeepseekV3ForCausalLM", DeepseekV3ForCausalLM, LatentKVLayout())  # Kimi K2 too
# Kimi K2.5+ (moonshot's name and transformers'): the DeepSeek-V3 text model of a multimodal
# checkpoint, its config's text_config read as the model's (densa.model.arch).
for _name in ("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration"):
    register_model(_name, KimiK25ForConditionalGeneration, LatentKVLayout())
# MLA + sparse attention: latents and the indexer's keys in the same pages.
register_model("DeepseekV32ForCausalLM", DeepseekV32ForCausalLM, SparseLatentKVLayout())
register_model("GlmMoeDsaForCausalLM", GlmMoeDsaForCausalLM, SparseLatentKVLayout())
register_model("GptOssForCausalLM", GptOssForCausalLM)  # sinks, sliding layers, MXFP4 experts
# Gated DeltaNet + gated full attention: pages for the full layers, state slots for the others.
register_model("Qwen3NextForCausalLM", Qwen3NextForCausalLM, HybridKVLayout())
register_model("Qwen3_5ForCausalLM", Qwen3_5ForCausalLM, HybridKVLayout())  # text, dense
register_model("Qwen3_5MoeForCausalLM", Qwen3_5MoeForCausalLM, HybridKVLayout())  # text, MoE


# The init functions the modules' reset_parameters call (nn.Linear, nn.Embedding, ...).
_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_",
                   "xavier_uniform_", "xavier_normal_", "constant_", "zeros_", "ones_")  # fmt: skip


@contextlib.contextmanager
def meta_skeleton() -> Iterator[None]:
    """Build models inside on the meta device (shapes, no storage), without random init.

    There are no values to initialize on meta, yet torch still runs each module's init through
    its reference kernels, and those import torch._dynamo and with it triton: ~1 s per model
    built and ~70 MB resident in every engine process for nothing. Inside this block the
    `torch.nn.init` functions return their tensor untouched. Not thread-safe (they are patched
    module-wide): engines are built by one thread."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, _untouched)
        with torch.device("meta"):
            yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def _untouched(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor
