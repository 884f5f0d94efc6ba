"""Huge-page rehoming keeps every value, sharing and alignment."""

from __future__ import annotations

import torch
from torch import nn

from densa.memory import HUGE_PAGE_BYTES, huge_page_zeros, rehome_on_huge_pages


def test_rehomed_module_is_unchanged_and_shares_tied_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50))
    model[1].weight = model[0].weight  # tied, as in SmolLM2
    model.register_buffer("table", torch.arange(7, dtype=torch.int64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moved = rehome_on_huge_pages(model)
    assert moved >= sum(v.numel() * v.element_size() for v in before.values()) - 50 * 8 * 4
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
        assert value.data_ptr() % 64 == 0
    assert model[1].weight is model[0].weight
    out = model(torch.tensor([3, 4]))  # still a working module
    assert out.shape == (2, 50)


def test_huge_page_zeros_is_aligned_and_zero() -> None:
    tensor = huge_page_zeros((3, 5, 7), torch.bfloat16)
    assert tensor.shape == (3, 5, 7) and tensor.dtype == torch.bfloat16
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not tensor.any()
    tensor.fill_(1.5)
    assert float(tensor.float().sum()) == 1.5 * 105
