"""Calibration for GPTQ: the Hessians of each linear layer's inputs (H = 2/n * X^T X over n
calibration tokens), collected with forward hooks while real text runs through the model (the
text: densa.measure.data.calibration_passages)."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import torch
from torch import nn


class HessianCollector:
    """Accumulates 2/n * X^T X of the inputs of the given modules while the model runs.

    Use as a context manager around the calibration forward passes; `hessians` maps each module
    name to its [in_features, in_features] float64 Hessian afterwards."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = modules
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}
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

    def _hook(self, name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # [tokens, in]
            if name not in self._sums:
                self._sums[name] = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
                self._counts[name] = 0
            # fp32 products (an fp64 matmul is ~10x slower here), summed across calls in fp64.
            self._sums[name] += (x.T @ x).double()
            self._counts[name] += x.shape[0]

        return record

    @property
    def num_tokens(self) -> int:
        return max(self._counts.values(), default=0)

    @property
    def hessians(self) -> dict[str, torch.Tensor]:
        return {name: 2.0 * total / self._counts[name] for name, total in self._sums.items()}
