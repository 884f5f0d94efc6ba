"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) and its causal short conv, in torch.

Each value head keeps a state S [Dk, Dv] (float32). One token t, with q and k already
l2-normalized and q scaled by Dk ** -0.5:

    S = S * exp(g_t)                      decay (g <= 0, per head, or per key row)
    S = S + k_t (beta_t (v_t - S^T k_t))^T    the delta rule: write only what S mispredicts
    o_t = S^T q_t

Decode runs that step once per request over a pool of state slots: that is
`densa.kernels.cpu.delta_rule.delta_rule_decode` (the C++ kernel, with its torch fallback).
Prefill runs a whole chunk of a prompt at once in the chunked (WY) form: within a chunk of C
tokens, with G_t = g_1 + ... + g_t (the decay from the chunk's start to t) and
u_t = beta_t (v_t - S_{t-1}^T k_t) after decay, the u's solve one unit-lower-triangular system

    u_t + sum_{s<t} beta_t exp(G_t - G_s) (k_t . k_s) u_s = beta_t (v_t - exp(G_t) S0^T k_t)

and then, all as matmuls,

    o_t  = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s
    S_C  = exp(G_C) S0 + sum_s exp(G_C - G_s) k_s u_s^T

Chunks are scanned in order, so a prompt split across engine steps at any boundary gives the
same state as one pass (the state is the whole history).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per triangular solve: the matmul sizes Qwen3-Next's reference uses


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the form the reference library uses)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """T tokens of one request from `state` [H, Dk, Dv] float32, which becomes the state after
    them (in place). q, k [T, H, Dk]; v [T, H, Dv]; log_decay, beta [T, H]. Returns o [T, H, Dv]
    float32. Padding to whole chunks uses k = 0, beta = 0, g = 0: padded tokens write nothing."""
    num_tokens = q.shape[0]
    chunk = min(chunk, num_tokens)  # exact for any size: a short prompt chunk pads nothing
    pad = (-num_tokens) % chunk
    q, k, v = (F.pad(x.float(), (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    log_decay, beta = (F.pad(x.float(), (0, 0, 0, pad)) for x in (log_decay, beta))
    num_heads = q.shape[1]

    def by_chunk(x: torch.Tensor) -> torch.Tensor:  # [T', H, D] -> [H, N, C, D]
        return x.view(-1, chunk, num_heads, x.shape[-1]).permute(2, 0, 1, 3)

    q, k, v = by_chunk(q), by_chunk(k), by_chunk(v)
    g, b = by_chunk(log_decay[..., None])[..., 0], by_chunk(beta[..., None])[..., 0]  # [H, N, C]
    out = _chunk_scan(q, k, v, g.cumsum(dim=-1), b, state)  # [H, N, C, Dv]
    return out.permute(1, 2, 0, 3).reshape(-1, num_heads, v.shape[-1])[:num_tokens]


def _chunk_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cum_decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """q, k [H, N, C, Dk]; v [H, N, C, Dv]; cum_decay (G), beta [H, N, C]; state [H, Dk, Dv]."""
    chunk = q.shape[2]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # pair[t, s] = exp(G_t - G_s) for s <= t, else 0 (masked before exp: no overflow)
    pair = (cum_decay[..., :, None] - cum_decay[..., None, :]).masked_fill(~causal, -torch.inf)
    pair = pair.exp()  # [H, N, C, C]
    strict = ((k @ k.transpose(-1, -2)) * pair * beta[..., :, None]).tril(-1)  # s < t
    system = strict + torch.eye(chunk, device=q.device)
    from_start = cum_decay.exp()[..., None]  # exp(G_t) [H, N, C, 1]
    # u = U_v - U_k S0 per chunk, with U_v, U_k solved once for all chunks
    solved = torch.linalg.solve_triangular(
        system, torch.cat([beta[..., None] * v, beta[..., None] * from_start * k], -1),
        upper=False, unitriangular=True,
    )  # fmt: skip
    u_values, u_keys = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    attend = (q @ k.transpose(-1, -2)) * pair  # [H, N, C, C]
    to_end = (cum_decay[..., -1:] - cum_decay).exp()[..., None]  # exp(G_C - G_s)
    out = torch.empty_like(u_values)
    for n in range(q.shape[1]):
        u = u_values[:, n] - u_keys[:, n] @ state  # [H, C, Dv]
        out[:, n] = (from_start[:, n] * q[:, n]) @ state + attend[:, n] @ u
        chunk_decay = cum_decay[:, n, -1].exp()[:, None, None]
        state.copy_(state * chunk_decay + (to_end[:, n] * k[:, n]).transpose(-1, -2) @ u)
    return out


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over T new inputs of B requests. x [B, C, T]; conv_state
    [B, C, K-1], the inputs before these (zeros at a prompt's start), replaced in place by the
    last K-1 inputs; weight [C, K]. Returns [B, C, T]."""
    window = weight.shape[-1] - 1
    extended = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # [B, C, K-1+T]
    conv_state.copy_(extended[..., extended.shape[-1] - window :])
    out = F.conv1d(extended, weight.unsqueeze(1).to(x.dtype), groups=weight.shape[0])
    return F.silu(out)
