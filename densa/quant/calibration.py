"""Calibration for GPTQ: the Hessians of each linear layer's inputs (H = 2/n * X^T X over n
calibration tokens), collected with forward hooks while real text runs through the model (the
text: densa.quant.calibration_data.calibration_passages).

Stacked expert layers (called with rows sorted by expert and their ExpertSegments) get one
Hessian per expert, over the tokens routed to it: [experts, in, in]; an expert no token reached
keeps a zero Hessian (the quantizer then rounds it to nearest)."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import torch
from torch import nn

from densa.kernels.cpu.grouped_linear import ExpertSegments


class HessianCollector:
    """Accumulates 2/n * X^T X of the inputs of the given modules while the model runs.

    Use as a context manager around the calibration forward passes; `hessians` maps each module
    name to its [in_features, in_features] float64 Hessian afterwards."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = modules
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}  # tokens seen, per layer or per expert
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> HessianCollector:
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str) -> Callable[[nn.Module, tuple[object, ...]], None]:
        def record(module: nn.Module, args: tuple[object, ...]) -> None:
            inputs = args[0]
            assert isinstance(inputs, torch.Tensor)
            x = inputs.detach().reshape(-1, inputs.shape[-1]).float()  # [tokens, in]
            segments = args[1] if len(args) > 1 else None
            if isinstance(segments, ExpertSegments):
                num_experts = int(getattr(module, "num_experts"))  # noqa: B009
                for expert, start, end in segments:
                    self._add(name, x[start:end], (num_experts, expert))
            else:
                self._add(name, x, None)

        return record

    def _add(self, name: str, x: torch.Tensor, expert: tuple[int, int] | None) -> None:
        """Fold X^T X into the sums: of the layer, or (expert = (num_experts, e)) of expert e."""
        if name not in self._sums:
            stack = () if expert is None else (expert[0],)
            self._sums[name] = torch.zeros(*stack, x.shape[1], x.shape[1], dtype=torch.float64)
            self._counts[name] = torch.zeros(stack or (1,), dtype=torch.int64)
        index = 0 if expert is None else expert[1]
        # fp32 products (an fp64 matmul is ~10x slower here), summed across calls in fp64.
        target = self._sums[name] if expert is None else self._sums[name][index]
        target += (x.T @ x).double()
        self._counts[name][index] += x.shape[0]

    @property
    def num_tokens(self) -> int:
        """Calibration tokens seen by the busiest (non-expert) layer."""
        per_layer = [int(c[0]) for n, c in self._counts.items() if self._sums[n].dim() == 2]
        return max(per_layer, default=0)

    @property
    def hessians(self) -> dict[str, torch.Tensor]:
        """[in, in] per layer, [experts, in, in] per stacked expert layer."""
        out = {}
        for name, total in self._sums.items():
            counts = self._counts[name].clamp(min=1).double()
            out[name] = 2.0 * total / (counts.view(-1, 1, 1) if total.dim() == 3 else counts)
        return out
