// The delta rule's decode recurrence over a pool of state slots (delta_rule.cpp).
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace densa {

// T tokens of B requests through their heads' states, in place (Gated DeltaNet, Kimi's KDA):
//
//   state_pool  float32 [num_slots, H, Dk, Dv], each slot's [H, Dk, Dv] contiguous (the slot
//               stride is free); only the rows slot_ids are read and written
//   slot_ids    int64 [B], distinct
//   q, k        float32 [B, T, H, Dk]   (already l2-normalized, q scaled: the caller's work)
//   v           float32 [B, T, H, Dv]
//   log_decay   float32 [B, T, H] (GDN: one per head) or [B, T, H, Dk] (KDA: per key channel)
//   beta        float32 [B, T, H]
//   -> out      float32 [B, T, H, Dv]
//
// Per token: S = S * exp(log_decay)[:, None]; delta = beta * (v - k^T S);
// S = S + outer(k, delta); out = q^T S. Each (request, head) is one thread's work, reduced in
// one fixed order, so results are bitwise the same across runs and thread counts.
at::Tensor delta_rule_steps(const at::Tensor& state_pool, const at::Tensor& slot_ids,
                            const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& log_decay, const at::Tensor& beta,
                            const std::string& isa);

}  // namespace densa
