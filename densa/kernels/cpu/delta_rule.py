"""The delta rule's decode step over a pool of recurrent-state slots (Gated DeltaNet in
Qwen3-Next / Qwen3.5, Kimi Linear's KDA), updating each request's state in place.

Per (request b, head h), with S = state_pool[slot_ids[b], h] ([Dk, Dv], row i per key channel):

    S      = S * exp(log_decay)[:, None]     GDN: one decay per head; KDA: one per key channel
    delta  = beta * (v - k^T S)
    S      = S + outer(k, delta)             written back to the slot
    out    = q^T S

What the caller has done already: q and k are l2-normalized and q is scaled, and the heads are
the value heads. GDN has num_v_heads >= num_k_heads, each q/k head serving a group of value
heads: the caller repeats q and k to H = num_v_heads (`repeat_interleave` over the head dim)
before the call, so every head here has its own q, k, v and state.

Two implementations of one computation:
- densa's C++ kernel (`csrc/delta_rule.cpp`, AVX-512 and AVX2 paths, without the GIL): each
  (request, head) reads its slot's state once and writes it once, in column blocks held in L1;
  no gathered copy, slots not in slot_ids untouched. Bitwise deterministic (one thread per
  (request, head), a fixed reduction order).
- a torch fallback where the kernel is not built or the state is not laid out as it reads
  (gathers the slots' states, updates them, scatters them back).
Both are tested against `densa.kernels.reference.delta_rule`.
"""

from __future__ import annotations

import torch

from densa.kernels.cpu import native


def delta_rule_decode(
    state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """One decode token per request, state updated in place.

    state_pool: float32 [num_slots, H, Dk, Dv] (each slot's [H, Dk, Dv] contiguous; only the
    rows slot_ids change), slot_ids: int64 [B] distinct, q / k: [B, H, Dk], v: [B, H, Dv],
    log_decay: [B, H] (GDN) or [B, H, Dk] (KDA), beta: [B, H]; float32 or bfloat16 (widened).
    Returns float32 [B, H, Dv].
    """
    steps = (x.unsqueeze(1) for x in (q, k, v, log_decay, beta))
    return delta_rule_decode_steps(state_pool, slot_ids, *steps).squeeze(1)


def delta_rule_decode_steps(
    state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """T tokens per request in order (speculative verification): q / k [B, T, H, Dk],
    v [B, T, H, Dv], log_decay [B, T, H] or [B, T, H, Dk], beta [B, T, H] -> float32
    [B, T, H, Dv]; the slots end holding the state after the T-th token."""
    q, k, v, log_decay, beta = (_float(x) for x in (q, k, v, log_decay, beta))
    slot_ids = slot_ids.to(torch.int64).contiguous()
    if _native_reads(state_pool):
        ext = native.load()
        assert ext is not None
        out: torch.Tensor = ext.delta_rule_steps(
            state_pool, slot_ids, q, k, v, log_decay, beta, native.isa()
        )
        return out
    return torch_delta_rule_steps(state_pool, slot_ids, q, k, v, log_decay, beta)


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous()


def _native_reads(state_pool: torch.Tensor) -> bool:
    """Whether the C++ kernel reads this pool: float32 on the CPU, each slot contiguous."""
    if state_pool.dtype != torch.float32 or state_pool.device.type != "cpu":
        return False
    if state_pool.dim() != 4 or not state_pool[0].is_contiguous():
        return False
    return native.is_available()


def torch_delta_rule_steps(
    state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """The torch fallback, batched over requests and heads; arguments and result as
    `delta_rule_decode_steps` (inputs float32)."""
    if log_decay.dim() == 3:  # GDN: one decay per head, the same for every key row
        log_decay = log_decay.unsqueeze(-1).expand(k.shape)
    state = state_pool[slot_ids].float()  # [B, H, Dk, Dv]: a gathered copy
    outs = []
    for t in range(q.shape[1]):
        state = state * torch.exp(log_decay[:, t]).unsqueeze(-1)
        kv_mem = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - kv_mem)  # [B, H, Dv]
        state = state + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)  # + outer(k, delta)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    state_pool[slot_ids] = state.to(state_pool.dtype)
    return torch.stack(outs, dim=1)
