"""The delta rule's decode recurrence (Gated DeltaNet, Kimi's KDA), one (request, head) at a time
in plain torch: the yardstick of `densa.kernels.cpu.delta_rule`.

Per token, with S the head's state [Dk, Dv] (row i belongs to key channel i):

    S      = S * exp(log_decay)[:, None]     decay each key row (GDN: one scalar per head)
    kv_mem = k^T S                           [Dv]: what the state recalls for k
    delta  = beta * (v - kv_mem)             [Dv]: the correction the delta rule writes
    S      = S + outer(k, delta)
    out    = q^T S                           [Dv]
"""

from __future__ import annotations

import torch


def delta_rule_step_reference(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of one head: state [Dk, Dv], q / k [Dk], v [Dv], log_decay [] or [Dk], beta []
    -> (out [Dv], new state [Dk, Dv]), all float32; `state` is not modified."""
    decay = torch.exp(log_decay.float()).expand(k.shape[0])
    s = state.float() * decay[:, None]
    kv_mem = k.float() @ s
    delta = beta.float() * (v.float() - kv_mem)
    s = s + torch.outer(k.float(), delta)
    return q.float() @ s, s


def delta_rule_decode_steps_reference(
    state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """T tokens per request in order: state_pool [num_slots, H, Dk, Dv] float32 (rows slot_ids
    updated in place), slot_ids [B], q / k [B, T, H, Dk], v [B, T, H, Dv], log_decay [B, T, H]
    or [B, T, H, Dk], beta [B, T, H] -> out [B, T, H, Dv] float32."""
    batch, num_tokens, num_heads = q.shape[:3]
    out = torch.empty(batch, num_tokens, num_heads, v.shape[-1], dtype=torch.float32)
    for b, slot in enumerate(slot_ids.tolist()):
        for h in range(num_heads):
            state = state_pool[slot, h]
            for t in range(num_tokens):
                out[b, t, h], state = delta_rule_step_reference(
                    state, q[b, t, h], k[b, t, h], v[b, t, h], log_decay[b, t, h], beta[b, t, h]
                )
            state_pool[slot, h] = state
    return out


def delta_rule_decode_reference(
    state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """One token per request: q / k [B, H, Dk], v [B, H, Dv], log_decay [B, H] or [B, H, Dk],
    beta [B, H] -> out [B, H, Dv]; state_pool as in `delta_rule_decode_steps_reference`."""
    steps = (x.unsqueeze(1) for x in (q, k, v, log_decay, beta))
    return delta_rule_decode_steps_reference(state_pool, slot_ids, *steps).squeeze(1)
