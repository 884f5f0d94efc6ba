"""What the worker needs from a model family: the contract every registered model implements."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from densa.model.attention import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from densa.model.fused_decode import FusedDecodeSwitch


class CausalLM(nn.Module, abc.ABC):
    """A decoder-only language model over a flattened batch of tokens and paged KV."""

    # How its linear weights are stored at run time, for people (set by the loader).
    weight_format: str = "dense"
    # Its decode-only steps can run through the fused C++ step (model/fused_decode.py): the
    # families that can set their switch; None = they always run layer by layer.
    fused_decode: FusedDecodeSwitch | None = None

    @abc.abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],  # one per layer, of the family's KV layout (model.kv_layout)
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]. Writes this step's K/V."""

    @abc.abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named checkpoint tensors in; raise KeyError/ValueError on mismatch."""

    def checkpoint_target(self, hf_name: str) -> str:
        """The parameter name a Hugging Face checkpoint tensor loads into (identity unless the
        family fuses projections); quantization uses it to find the layer behind a tensor."""
        return hf_name

    def normalize_checkpoint(self, tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Checkpoint tensors in this family's canonical names and shapes (MoE families stack
        per-expert weights); the stream passes through unchanged for most families."""
        return tensors

    def tie_weights(self) -> None:
        """Re-share tied parameters (materializing a meta-built model unties them)."""
