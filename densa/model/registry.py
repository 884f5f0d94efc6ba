"""Model families by the architecture name in config.json: a registry, not name sniffing."""

from __future__ import annotations

from collections.abc import Callable

import torch

from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.interface import CausalLM
from densa.model.llama import LlamaForCausalLM

ModelFactory = Callable[[ArchConfig, int, torch.device], CausalLM]

_REGISTRY: dict[str, ModelFactory] = {}


def register_model(architecture: str, factory: ModelFactory) -> None:
    _REGISTRY[architecture] = factory


def model_factory(architecture: str) -> ModelFactory:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(_REGISTRY))
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; densa runs: {supported}"
        ) from None


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


# Llama's layout covers these families: Mistral is Llama with GQA, Qwen2 adds q/k/v biases (read
# from the config), SmolLM2 is Llama with tied embeddings.
for _name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
    register_model(_name, LlamaForCausalLM)
