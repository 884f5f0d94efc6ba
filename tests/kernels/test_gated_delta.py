"""The gated delta rule's torch forms against a token loop written from the definition:
S = S * exp(g); S += k (beta (v - S^T k))^T; o = S^T q, one token at a time."""

from __future__ import annotations

import pytest
import torch

from densa.kernels.cpu.delta_rule import delta_rule_decode
from densa.kernels.gated_delta import (
    causal_conv,
    chunked_delta_rule,
    l2_normalize,
)

H, DK, DV = 3, 8, 6


def token_loop(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    """o [T, H, Dv] and the final state, one token and one head at a time."""
    state = state.clone()
    out = torch.empty(q.shape[0], H, DV)
    for t in range(q.shape[0]):
        for h in range(H):
            s = state[h] * torch.exp(g[t, h])
            s = s + torch.outer(k[t, h], beta[t, h] * (v[t, h] - s.T @ k[t, h]))
            out[t, h], state[h] = s.T @ q[t, h], s
    return out, state


def inputs(num_tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(num_tokens, H, DK, generator=gen)) * DK**-0.5
    k = l2_normalize(torch.randn(num_tokens, H, DK, generator=gen))
    v = torch.randn(num_tokens, H, DV, generator=gen)
    g = -torch.rand(num_tokens, H, generator=gen) * 0.5  # log decay <= 0
    beta = torch.rand(num_tokens, H, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("num_tokens", [1, 5, 64, 150])
def test_chunked_form_equals_the_token_loop(num_tokens: int) -> None:
    q, k, v, g, beta = inputs(num_tokens, seed=num_tokens)
    start = torch.randn(H, DK, DV, generator=torch.Generator().manual_seed(9))
    want_out, want_state = token_loop(q, k, v, g, beta, start)
    state = start.clone()
    out = chunked_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", [1, 7, 64])
def test_a_prompt_split_into_chunks_of_any_size_gives_the_same_state(split: int) -> None:
    q, k, v, g, beta = inputs(100, seed=3)
    whole = torch.zeros(H, DK, DV)
    whole_out = chunked_delta_rule(q, k, v, g, beta, whole)
    state, outs = torch.zeros(H, DK, DV), []
    for lo in range(0, 100, split):
        rows = slice(lo, lo + split)
        outs.append(chunked_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], state))
    torch.testing.assert_close(state, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(outs), whole_out, atol=1e-5, rtol=1e-5)


def test_decode_updates_only_its_slots_and_matches_the_loop() -> None:
    q, k, v, g, beta = inputs(2, seed=5)  # two requests, one token each
    pool = torch.randn(4, H, DK, DV, generator=torch.Generator().manual_seed(1))
    before = pool.clone()
    slots = torch.tensor([3, 1])
    out = delta_rule_decode(pool, slots, q, k, v, g, beta)
    for row, slot in enumerate(slots.tolist()):
        rows = slice(row, row + 1)
        want_out, want_state = token_loop(
            q[rows], k[rows], v[rows], g[rows], beta[rows], before[slot]
        )
        torch.testing.assert_close(out[row], want_out[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(pool[slot], want_state, atol=1e-6, rtol=1e-6)
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[2], before[2])


def test_per_key_row_decay_decays_each_row_by_its_own_gate() -> None:
    q, k, v, _, beta = inputs(1, seed=6)
    g = -torch.rand(1, H, DK, generator=torch.Generator().manual_seed(2))
    pool = torch.randn(1, H, DK, DV, generator=torch.Generator().manual_seed(4))
    s = pool[0] * g[0].exp()[..., None]  # [H, Dk, Dv]
    s = (
        s
        + k[0][..., None]
        * (beta[0][:, None] * (v[0] - torch.einsum("hk,hkv->hv", k[0], s)))[:, None]
    )
    out = delta_rule_decode(pool, torch.tensor([0]), q, k, v, g, beta)
    torch.testing.assert_close(pool[0], s, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[0], torch.einsum("hk,hkv->hv", q[0], s), atol=1e-6, rtol=1e-6)


def test_causal_conv_carries_its_window_across_calls() -> None:
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(1, 5, 9, generator=gen), torch.randn(5, 4, generator=gen)
    padded = torch.nn.functional.pad(x, (3, 0))  # zeros before the prompt
    want = torch.nn.functional.silu(torch.stack(
        [(padded[0, :, t : t + 4] * weight).sum(-1) for t in range(9)], dim=-1
    ))  # fmt: skip
    state = torch.zeros(1, 5, 3)
    got = torch.cat(
        [causal_conv(x[..., :4], state, weight), causal_conv(x[..., 4:], state, weight)], -1
    )
    torch.testing.assert_close(got[0], want, atol=1e-6, rtol=1e-6)
    assert torch.equal(state, x[..., -3:])
