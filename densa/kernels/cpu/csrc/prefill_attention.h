// Chunked-prefill attention over KV pages, tiled (prefill_attention.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "decoder.h"
#include "qgemm.h"

namespace densa {

// Causal attention of B prefill chunks over their pages, flash-style: each (sequence, kv head,
// tile of query rows) walks its context in blocks of kFlashKeyBlock keys with an online softmax,
// so memory is bounded by the tile (a few hundred KB per thread), not by query x context.
//
//   q          float32 [total_q, H, D], unscaled; sequence b owns query_lens[b] consecutive rows
//              at positions seq_lens[b] - query_lens[b] + j
//   k, v       the layer's pages (any KV format the fused decoder reads)
//   new_k/v    float32 [total_q, Hkv, D] or nullptr: the chunk's own K/V as computed, read
//              instead of the pages for the chunk's positions (FP8 / INT8 pages, attention.py)
//   out        float32 [total_q, H, D]
//
// Every output row is reduced in one order fixed by its own position (key blocks at absolute
// positions 0, kFlashKeyBlock, ...; dot products over D in order; blocks past the row are exact
// no-ops), so a row computes the same bits whatever chunk, tile or batch it is in.
struct PrefillInputs {
  const float* q;
  int64_t num_heads, head_dim;
  const int32_t* page_table;
  int64_t max_pages;
  const int32_t* seq_lens;
  const int32_t* query_lens;
  int64_t batch;
  float sm_scale;
  const float* new_k = nullptr;
  const float* new_v = nullptr;
  const float* fp8_table;
  float* out;
};

constexpr int kFlashKeyBlock = 64;

void prefill_attention(const KVSide& k, const KVSide& v, const PrefillInputs& in, Isa isa);

}  // namespace densa
