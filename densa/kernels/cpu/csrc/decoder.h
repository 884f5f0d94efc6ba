// The fused decode step (decoder.cpp): data it needs, as plain structs built once per engine.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "qgemm.h"

namespace densa {

constexpr int kKvF32 = 0, kKvBf16 = 1, kKvFp8 = 2, kKvInt8 = 3;

struct Config {
  int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim;
  float eps;
};

// One side (K or V) of one layer's pages: [num_pages, num_kv_heads, page_size, head_dim].
struct KVSide {
  at::Tensor tensor;  // keeps the memory alive
  void* data = nullptr;
  int dtype = kKvF32;
  int64_t num_kv_heads = 0, page_size = 0;
  at::Tensor exponent_tensor;       // fp8 dynamic scales: int8 [num_pages, kv_heads, page_size]
  int8_t* exponents = nullptr;      // nullptr: a static scale
  at::Tensor row_scale_tensor;      // int8 caches: fp16 [num_pages, kv_heads, page_size]
  uint16_t* row_scales = nullptr;
  float static_scale = 1.f;         // fp8 static: real = stored * static_scale
  float inv_static = 1.f;           // 1 / static_scale, as float32 (what the store multiplies by)
};

// A run of a projection's output rows in one format: dense float32 [out, in], or packed W4 / W5 /
// W5M / W6 / W6M / W8 blocks.
struct Shard {
  int bits = kFormatDense;
  at::Tensor dense, packed;
  const uint8_t* blocks = nullptr;
  int64_t out = 0;
};

// One projection: its shards' outputs side by side (most have one shard; a fused q|k|v whose
// v has more bits than q and k has two or three), plus a bias over the whole output.
struct Projection {
  std::vector<Shard> shards;
  at::Tensor bias_tensor;
  const float* bias = nullptr;
  int64_t out = 0, in = 0;
};

struct Layer {
  at::Tensor norms;  // keeps input_norm / post_norm alive
  const float* input_norm = nullptr;
  const float* post_norm = nullptr;
  Projection qkv, o, gate_up, down;
  KVSide k, v;
  // [kv heads * head dim] subtracted from every rotated key before it is stored (the model's
  // key center, densa/model/key_centering.py); nullptr: keys stored as computed.
  at::Tensor k_center_tensor;
  const float* k_center = nullptr;
};

struct StepInputs {
  int64_t num_tokens;
  const int64_t* token_ids;
  const int64_t* positions;
  const int32_t* page_table;  // [num_tokens, max_pages]
  int64_t max_pages;
  const int32_t* seq_lens;  // [num_tokens], including the new token
  const int64_t* slot_pages;
  const int64_t* slot_offsets;
  // The step's input rows [num_tokens, hidden], when the embedding is not a float32 table the
  // decoder can index (a quantized one, looked up by the caller); nullptr: look token_ids up.
  const float* embeddings = nullptr;
};

// Parts each (sequence, kv head)'s context is split into at decode, for `items` (sequence, kv
// head) pairs on `threads` threads and a longest context of `longest` tokens (decoder.cpp).
// Decode asks it for each sequence alone (items = its kv heads, longest = its length), so how a
// sequence is split never depends on the rest of the batch.
int64_t context_splits(int64_t items, int64_t threads, int64_t longest);

struct Decoder {
  Config config;
  Isa isa;
  at::Tensor embed, final_norm_tensor, cos, sin, fp8_table_tensor;  // embed: [0, hidden] when
                                                                     // steps bring their rows
  const float* final_norm = nullptr;
  const float* fp8_table = nullptr;
  std::vector<Layer> layers;
  // Every attention (decode steps included) through the tiled kernel, reading every position
  // from the pages: the deterministic mode (prefill_attention.h).
  bool tiled_attention = false;

  // Final hidden states [num_tokens, hidden] (normalized), K/V of the step stored in the pages.
  at::Tensor forward(const StepInputs& step) const;

  // One layer in two halves around an attention computed elsewhere (prefill and mixed steps):
  // qkv() normalizes the residual stream x [M, hidden], projects, rotates q and k (q unscaled)
  // and stores k, v in their slots, returning qkv [M, q + 2 kv]; mlp() adds the attention's
  // output projection and the MLP to x in place. final() is the last RMSNorm.
  at::Tensor qkv(int64_t layer, at::Tensor& x, const int64_t* positions, const int64_t* slot_pages,
                 const int64_t* slot_offsets) const;
  void mlp(int64_t layer, const at::Tensor& attn, at::Tensor& x) const;
  // forward()'s attention for rows computed by qkv(): row t reads the first seq_lens[t]
  // positions of page_table row t ([rows, max_pages]) -> [rows, q] (the deterministic mode's
  // attention for prefill rows, one row per prompt position).
  at::Tensor attend(int64_t layer, const at::Tensor& qkv, const int32_t* page_table,
                    int64_t max_pages, const int32_t* seq_lens) const;
  // The deterministic mode's attention for any step: `batch` sequences (decode rows with
  // query_len 1, prefill chunks) over their pages through the tiled kernel -> [rows, q].
  at::Tensor attend_tiled(int64_t layer, const at::Tensor& qkv, const int32_t* page_table,
                          int64_t max_pages, const int32_t* seq_lens, const int32_t* query_lens,
                          int64_t batch) const;
  at::Tensor final(const at::Tensor& x) const;
};

}  // namespace densa
