// The fused decode step: every layer of a Llama-family model for a batch of decode tokens in one
// call, so a step costs no Python dispatch per layer (30 layers x ~15 ops of eager PyTorch were
// most of a batch-1 step; see docs/benchmarks/peers/).
//
// Per layer, for M tokens (one per sequence), in float32:
//   h = rmsnorm(x) ; qkv = h Wqkv^T (+b) ; rotate q, k (rotate-half RoPE) ; store k, v in their
//   page slots (fp32 / bf16 / fp8 e4m3 with dynamic power-of-two or static scales, exactly as
//   densa.formats.fp8_kv stores them) ; o = paged attention over each sequence's pages (online
//   softmax, split-K over a long context as if its sequence were alone in the batch) ;
//   x += o Wo^T ; h = rmsnorm(x) ; x += (silu(h Wg^T) * h Wu^T) Wd^T
// and finally rmsnorm(x). Projections are dense fp32, W4, W5, W5M, W6, W6M or W8 (qgemm.h), or
// shards of those side by side (a fused q|k|v with v in more bits).
//
// Everything here mirrors the eager model (densa/model/llama.py) and the attention reference
// (densa/kernels/reference/paged_attention.py); tests/kernels/test_fused_decoder.py compares them.

#include "decoder.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "prefill_attention.h"
#include "vec.h"

namespace densa {
namespace {

constexpr int kBlockTokens = 32;     // tokens per online-softmax block
constexpr int kMinSplitTokens = 128;  // below this, splitting a sequence costs more than it saves
constexpr int64_t kMlpTileRows = 128;  // rows of MLP activations held at once (layer_mlp)
constexpr int kMaxGroup = 16;         // query heads per kv head the scratch is sized for
constexpr int kMaxHeadDim = 256;

// ---- KV store (scalar: M x kv heads x head_dim values per layer) -------------------------------
uint32_t f32_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

float f32_from_bits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// IEEE half <-> float, round to nearest even (what torch's .to(torch.float16) does), written
// out so it runs in any code path (F16C is not assumed here).
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return f32_from_bits(sign | 0x7F800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return f32_from_bits(sign);
    return (sign ? -1.f : 1.f) * std::ldexp(static_cast<float>(mantissa), -24);  // subnormal
  }
  return f32_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t float_to_half(float x) {
  const uint32_t bits = f32_bits(x);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const float a = std::fabs(x);
  if (a != a) return static_cast<uint16_t>(sign | 0x7E00u);
  if (a >= 65520.f) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to inf
  if (a < 6.103515625e-05f) {  // subnormal half: multiples of 2**-24
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.f)));
  }
  const uint32_t m = f32_bits(a);
  const uint32_t rounded = m + 0xFFFu + ((m >> 13) & 1u);  // round the 13 dropped bits to even
  return static_cast<uint16_t>(sign | ((rounded >> 13) - (112u << 10)));
}

uint16_t to_bf16(float x) {  // round to nearest even, like torch's .to(torch.bfloat16)
  const uint32_t b = f32_bits(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40);  // NaN
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

float finite(float x) {  // NaN -> 0, +-inf -> +-FLT_MAX (torch.nan_to_num)
  if (x != x) return 0.f;
  const float big = std::numeric_limits<float>::max();
  return std::max(std::min(x, big), -big);
}

uint8_t encode_e4m3(float y) {  // |y| <= 448; round to nearest even (kv_store._encode_e4m3)
  const uint32_t bits = f32_bits(y);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  uint32_t code;
  if (std::fabs(y) < 0.015625f) {  // below e4m3's smallest normal, 2**-6: multiples of 2**-9
    code = static_cast<uint32_t>(std::nearbyint(std::fabs(y) * 512.f));
  } else {
    const uint32_t lsb = (magnitude >> 20) & 1u;
    code = ((magnitude + 0x7FFFFu + lsb) >> 20) - 960u;
  }
  return static_cast<uint8_t>(sign | code);
}

int row_exponent(float amax) {  // kv_store._row_exponent: amax lands in (224, 448] * 2**e
  if (amax == 0.f) return 0;
  const uint32_t bits = f32_bits(amax);
  const int biased = static_cast<int>(bits >> 23);
  const int e = biased - 135 + ((bits & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  return std::max(-126, std::min(119, e));
}

// Write one (token, head) row of `d` values into its slot.
void store_row(const KVSide& side, int64_t page, int64_t head, int64_t slot, const float* x,
               int d) {
  const int64_t row = (page * side.num_kv_heads + head) * side.page_size + slot;
  if (side.dtype == kKvF32) {
    std::memcpy(static_cast<float*>(side.data) + row * d, x, d * sizeof(float));
  } else if (side.dtype == kKvBf16) {
    uint16_t* out = static_cast<uint16_t*>(side.data) + row * d;
    for (int i = 0; i < d; ++i) out[i] = to_bf16(x[i]);
  } else if (side.dtype == kKvInt8) {  // densa.formats.int8_kv.quantize_rows
    int8_t* out = static_cast<int8_t*>(side.data) + row * d;
    constexpr float kRowLimit = 65504.f * 127.f;
    float amax = 0.f;
    for (int i = 0; i < d; ++i)
      amax = std::max(amax, std::fabs(std::min(std::max(finite(x[i]), -kRowLimit), kRowLimit)));
    const uint16_t scale_bits = float_to_half(amax / 127.f);
    const float scale = half_to_float(scale_bits);
    for (int i = 0; i < d; ++i) {
      const float v = std::min(std::max(finite(x[i]), -kRowLimit), kRowLimit);
      const float q = scale > 0.f ? std::nearbyint(v / scale) : 0.f;
      out[i] = static_cast<int8_t>(std::min(std::max(q, -127.f), 127.f));
    }
    side.row_scales[row] = scale_bits;
  } else {
    uint8_t* out = static_cast<uint8_t*>(side.data) + row * d;
    float inv = side.inv_static;
    if (side.exponents != nullptr) {
      float amax = 0.f;
      for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(finite(x[i])));
      const int e = row_exponent(amax);
      inv = f32_from_bits(static_cast<uint32_t>(127 - e) << 23);  // 2**-e, exact
      side.exponents[row] = static_cast<int8_t>(e);
    }
    for (int i = 0; i < d; ++i) {
      float y = finite(x[i]) * inv;
      y = y == y ? std::min(std::max(y, -448.f), 448.f) : 0.f;
      out[i] = encode_e4m3(y);
    }
  }
}

// ---- attention ---------------------------------------------------------------------------------
// One (sequence, kv head, split)'s unnormalized result, a view into a flat scratch buffer:
// acc [G, D], then max [G], then sum [G].
struct Partial {
  float* acc;
  float* max;
  float* sum;
};

Partial partial_at(std::vector<float>& scratch, int64_t item, int64_t g_count, int64_t d) {
  float* base = scratch.data() + item * (g_count * d + 2 * g_count);
  return {base, base + g_count * d, base + g_count * d + g_count};
}

template <class Ops>
void attend_range(const Config& cfg, const KVSide& k, const KVSide& v, const int32_t* page_row,
                  int64_t head, int64_t t0, int64_t t1, const float* q, const float* fp8_table,
                  const Partial& out) {
  const int g_count = cfg.num_heads / cfg.num_kv_heads, d = cfg.head_dim;
  alignas(64) float kbuf[kBlockTokens * kMaxHeadDim];
  alignas(64) float vbuf[kBlockTokens * kMaxHeadDim];
  alignas(64) float s[kMaxGroup * kBlockTokens];
  for (int g = 0; g < g_count; ++g) {
    out.max[g] = -1e30f;
    out.sum[g] = 0.f;
    std::fill(out.acc + g * d, out.acc + (g + 1) * d, 0.f);
  }
  alignas(64) float alpha[kMaxGroup];
  alignas(64) float k_scales[kBlockTokens], v_scales[kBlockTokens];
  alignas(64) uint16_t k_halves[kBlockTokens], v_halves[kBlockTokens];
  int64_t rows[kBlockTokens];
  const int64_t elem = k.dtype == kKvF32 ? 4 : (k.dtype == kKvBf16 ? 2 : 1);
  // The block's row scales: fp16 (INT8 pages) widened together, fp8 exponents as powers of two.
  auto block_scales = [&](const KVSide& side, int n, uint16_t* halves, float* out) {
    if (side.row_scales != nullptr) {
      for (int j = 0; j < n; ++j) halves[j] = side.row_scales[rows[j]];
      Ops::halves_to_float(halves, n, out);
    } else {
      for (int j = 0; j < n; ++j)
        out[j] = side.exponents ? std::ldexp(1.f, side.exponents[rows[j]]) : side.static_scale;
    }
  };
  for (int64_t b0 = t0; b0 < t1; b0 += kBlockTokens) {
    const int n = static_cast<int>(std::min<int64_t>(kBlockTokens, t1 - b0));
    for (int j = 0; j < n; ++j) {
      const int64_t t = b0 + j, page = page_row[t / k.page_size], slot = t % k.page_size;
      rows[j] = (page * k.num_kv_heads + head) * k.page_size + slot;
    }
    block_scales(k, n, k_halves, k_scales);
    block_scales(v, n, v_halves, v_scales);
    for (int j = 0; j < n; ++j) {
      Ops::widen(static_cast<const uint8_t*>(k.data) + rows[j] * d * elem, k.dtype, d,
                 k_scales[j], fp8_table, kbuf + j * d);
      Ops::widen(static_cast<const uint8_t*>(v.data) + rows[j] * d * elem, v.dtype, d,
                 v_scales[j], fp8_table, vbuf + j * d);
    }
    Ops::scores(q, g_count, d, kbuf, n, s, kBlockTokens);
    for (int g = 0; g < g_count; ++g) {
      float block_max = out.max[g];
      for (int j = 0; j < n; ++j) block_max = std::max(block_max, s[g * kBlockTokens + j]);
      alpha[g] = std::exp(out.max[g] - block_max);
      out.max[g] = block_max;
      const float total = Ops::exp_shifted(s + g * kBlockTokens, n, block_max);
      out.sum[g] = out.sum[g] * alpha[g] + total;
    }
    Ops::weighted_sum(out.acc, alpha, s, kBlockTokens, vbuf, n, d, g_count);
  }
}

// Decode attention for every sequence: q [M, H, D] (scaled) -> out [M, H, D].
// Each sequence's context is cut into the parts it would get alone in the batch (context_splits
// of its own kv heads and length), and its parts are merged in order: a sequence's result never
// depends on which others share the step (docs/architecture.md, "Batch invariance").
template <class Ops>
void decode_attention(const Config& cfg, const KVSide& k, const KVSide& v, const float* q,
                      const int32_t* page_table, int64_t max_pages, const int32_t* seq_lens,
                      int64_t batch, const float* fp8_table, std::vector<float>& scratch,
                      float* out) {
  const int64_t kvh = cfg.num_kv_heads, g_count = cfg.num_heads / kvh, d = cfg.head_dim;
  const int64_t threads = at::get_num_threads();
  // Items (sequence, kv head, part), sequence by sequence: b's are [first[b], first[b + 1]).
  std::vector<int64_t> first(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b)
    first[b + 1] = first[b] + kvh * context_splits(kvh, threads, seq_lens[b]);
  const int64_t items = first[batch];
  const size_t needed = static_cast<size_t>(items * (g_count * d + 2 * g_count));
  if (scratch.size() < needed) scratch.resize(needed);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
      const int64_t splits = (first[b + 1] - first[b]) / kvh;
      const int64_t h = (item - first[b]) / splits, part = (item - first[b]) % splits;
      const int64_t len = seq_lens[b];
      // Page-aligned shares of the context.
      const int64_t pages = (len + k.page_size - 1) / k.page_size;
      const int64_t per = (pages + splits - 1) / splits;
      const int64_t t0 = std::min(len, part * per * k.page_size);
      const int64_t t1 = std::min(len, (part + 1) * per * k.page_size);
      const Partial p = partial_at(scratch, item, g_count, d);
      if (t0 >= t1) {
        for (int g = 0; g < g_count; ++g) p.max[g] = -1e30f, p.sum[g] = 0.f;
        std::fill(p.acc, p.acc + g_count * d, 0.f);
        continue;
      }
      attend_range<Ops>(cfg, k, v, page_table + b * max_pages, h, t0, t1,
                        q + (b * cfg.num_heads + h * g_count) * d, fp8_table, p);
    }
  });
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t splits = (first[b + 1] - first[b]) / kvh;
    for (int64_t h = 0; h < kvh; ++h) {
      const int64_t head_first = first[b] + h * splits;
      for (int64_t g = 0; g < g_count; ++g) {
        float m = -1e30f;
        for (int64_t s = 0; s < splits; ++s)
          m = std::max(m, partial_at(scratch, head_first + s, g_count, d).max[g]);
        float total = 0.f;
        float* o = out + (b * cfg.num_heads + h * g_count + g) * d;
        std::fill(o, o + d, 0.f);
        for (int64_t s = 0; s < splits; ++s) {
          const Partial p = partial_at(scratch, head_first + s, g_count, d);
          const float w = std::exp(p.max[g] - m);
          total += p.sum[g] * w;
          for (int64_t i = 0; i < d; ++i) o[i] += p.acc[g * d + i] * w;
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t i = 0; i < d; ++i) o[i] *= inv;
      }
    }
  }
}

// ---- projections -------------------------------------------------------------------------------
constexpr int kDenseTile = 4;          // tokens per dense_rows call
constexpr int kDenseRowBlock = 16;     // weight rows walked against a token tile (in L1)
constexpr int kDenseTokenBlock = 64;   // tokens walked against a thread's weight rows (in L2)

// y = x W^T for dense float32 W [out, in] and any number of rows (y's rows `ldy` apart). Every
// y[t, r] is the same arithmetic whatever `rows` (vec.h dense_rows), so a token's result never
// depends on the batch it is in; torch's GEMM, which ran steps of more than 8 rows before, rounds
// a row differently at different M (one row alone is a GEMV). Decode streams each weight row once
// for all its tokens.
template <class Ops>
void dense_project(const float* w, int64_t in, int64_t out, const float* x, int64_t rows,
                   float* y, int64_t ldy) {
  constexpr int R = Ops::kDenseRows;
  at::parallel_for(0, out, kDenseRowBlock, [&](int64_t r0, int64_t r1) {
    for (int64_t t0 = 0; t0 < rows; t0 += kDenseTokenBlock) {
      const int64_t t_end = std::min(rows, t0 + kDenseTokenBlock);
      for (int64_t b0 = r0; b0 < r1; b0 += kDenseRowBlock) {
        const int64_t b1 = std::min(r1, b0 + kDenseRowBlock);
        for (int64_t t = t0; t < t_end; t += kDenseTile) {
          const int64_t n = std::min<int64_t>(kDenseTile, t_end - t);
          const float* xt = x + t * in;
          float* yt = y + t * ldy;
          // Full tiles take R weight rows at a time (compute-bound: more accumulators per
          // load); a few tokens stream the rows one by one (measured faster at one token).
          if (n == 4) Ops::template dense_rows<4, R>(w, in, b0, b1, xt, yt, ldy);
          else if (n == 3) Ops::template dense_rows<3>(w, in, b0, b1, xt, yt, ldy);
          else if (n == 2) Ops::template dense_rows<2>(w, in, b0, b1, xt, yt, ldy);
          else Ops::template dense_rows<1>(w, in, b0, b1, xt, yt, ldy);
        }
      }
    }
  });
}

// One shard's output columns of y[rows, ldy] (its first column at y).
template <class Ops>
void project_shard(const Shard& s, int64_t in, const float* x, int64_t rows, float* y,
                   int64_t ldy, Isa isa, ActivationBuffers& buffers) {
  if (is_quantized_format(s.bits)) {
    quantized_linear_raw(x, rows, in, s.blocks, s.out, s.bits, isa, y, ldy, buffers);
  } else if (s.bits == kFormatW8) {
    w8float_linear_raw(x, rows, in, s.blocks, s.out, isa, y, ldy);
  } else if (is_fp4_float_format(s.bits)) {
    fp4float_linear_raw(x, rows, in, s.blocks, s.out, s.bits, isa, y, ldy);
  } else {
    dense_project<Ops>(s.dense.data_ptr<float>(), in, s.out, x, rows, y, ldy);
  }
}

// y[rows, p.out] = x p.W^T (+ b): each shard writes its own columns in place.
template <class Ops>
void project(const Projection& p, const float* x, int64_t rows, float* y, Isa isa,
             ActivationBuffers& buffers) {
  int64_t col = 0;
  for (const Shard& s : p.shards) {
    project_shard<Ops>(s, p.in, x, rows, y + col, p.out, isa, buffers);
    col += s.out;
  }
  if (p.bias != nullptr) {
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t i = 0; i < p.out; ++i) y[t * p.out + i] += p.bias[i];
  }
}

// Rotate-half RoPE of `heads` heads of one token in place: x * cos + rotate_half(x) * sin.
void rope(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

// Rows in parallel once there are enough of them (prefill chunks); decode batches stay serial.
template <class F>
void for_rows(int64_t rows, const F& body) {
  if (rows < 16) {
    for (int64_t t = 0; t < rows; ++t) body(t);
    return;
  }
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) body(t);
  });
}

template <class Ops>
void rmsnorm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
  for_rows(rows, [&](int64_t t) { Ops::rmsnorm(x + t * n, w, y + t * n, n, eps); });
}

// First half of a layer for M rows: h = rmsnorm(x); qkv = h Wqkv^T; rotate q and k; store k, v
// in their slots. qkv: [M, q + 2 kv], rotated, q unscaled.
template <class Ops>
void layer_qkv(const Decoder& dec, const Layer& L, const float* x, int64_t rows,
               const int64_t* positions, const int64_t* slot_pages, const int64_t* slot_offsets,
               float* h, float* qkv, ActivationBuffers& buffers) {
  const Config& cfg = dec.config;
  const int64_t d = cfg.head_dim, q_size = cfg.num_heads * d, kv_size = cfg.num_kv_heads * d;
  const int64_t qkv_size = q_size + 2 * kv_size;
  const float* cos = dec.cos.data_ptr<float>();
  const float* sin = dec.sin.data_ptr<float>();
  rmsnorm_rows<Ops>(x, L.input_norm, h, rows, cfg.hidden, cfg.eps);
  project<Ops>(L.qkv, h, rows, qkv, dec.isa, buffers);
  // Rows write distinct slots (each token owns its own), so they can go in parallel.
  for_rows(rows, [&](int64_t t) {
    float* row = qkv + t * qkv_size;
    const int64_t pos = positions[t];
    // q and k heads are adjacent: rotate them together.
    rope(row, cfg.num_heads + cfg.num_kv_heads, d, cos + pos * d, sin + pos * d);
    if (L.k_center != nullptr)
      for (int64_t i = 0; i < kv_size; ++i) row[q_size + i] -= L.k_center[i];
    for (int64_t kh = 0; kh < cfg.num_kv_heads; ++kh) {
      store_row(L.k, slot_pages[t], kh, slot_offsets[t], row + q_size + kh * d, d);
      store_row(L.v, slot_pages[t], kh, slot_offsets[t], row + q_size + kv_size + kh * d, d);
    }
  });
}

// Second half: x += attn Wo^T; x += (silu(h Wg^T) * h Wu^T) Wd^T with h = rmsnorm(x).
// gate|up and its product are the step's widest activations (3 x intermediate floats per row:
// 105 KB at Qwen2.5-1.5B), so they run kMlpTileRows rows at a time: a 512-token prefill chunk
// holds 13 MB of them instead of 55 MB. Each row's result is the same either way (activations
// are quantized per row), and a tile of 128 rows keeps the GEMMs' weight reuse.
template <class Ops>
void layer_mlp(const Decoder& dec, const Layer& L, const float* attn, int64_t rows, float* x,
               float* h, float* proj, float* gu, float* act, ActivationBuffers& buffers) {
  const Config& cfg = dec.config;
  const int64_t hid = cfg.hidden, inter = cfg.intermediate;
  auto add_rows = [&](float* dst, const float* src) {
    for_rows(rows, [&](int64_t t) {
      for (int64_t i = t * hid; i < (t + 1) * hid; ++i) dst[i] += src[i];
    });
  };
  project<Ops>(L.o, attn, rows, proj, dec.isa, buffers);
  add_rows(x, proj);
  rmsnorm_rows<Ops>(x, L.post_norm, h, rows, hid, cfg.eps);
  for (int64_t first = 0; first < rows; first += kMlpTileRows) {
    const int64_t tile = std::min(kMlpTileRows, rows - first);
    project<Ops>(L.gate_up, h + first * hid, tile, gu, dec.isa, buffers);
    for_rows(tile, [&](int64_t t) {
      Ops::silu_mul(gu + t * 2 * inter, gu + t * 2 * inter + inter, act + t * inter, inter);
    });
    project<Ops>(L.down, act, tile, proj + first * hid, dec.isa, buffers);
  }
  add_rows(x, proj);
}

// Scratch for one call, reused across calls (grow-only: a fresh zero-filled allocation per call
// was a measurable share of a prefill step).
struct Buffers {
  std::vector<float> h, qkv, q, attn, proj, gu, act, scratch;
  ActivationBuffers quantized;

  void ensure(const Config& c, int64_t rows) {
    grow(h, rows * std::max(c.hidden, c.num_heads * c.head_dim));
    grow(qkv, rows * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim);
    grow(q, rows * c.num_heads * c.head_dim);
    grow(attn, rows * c.num_heads * c.head_dim);
    grow(proj, rows * c.hidden);
    grow(gu, std::min(rows, kMlpTileRows) * 2 * c.intermediate);
    grow(act, std::min(rows, kMlpTileRows) * c.intermediate);
  }

  static void grow(std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  }
};

// One set of buffers per calling thread (the engine calls from one thread at a time).
Buffers& buffers_for(const Config& c, int64_t rows) {
  thread_local Buffers buffers;
  buffers.ensure(c, rows);
  return buffers;
}

// The tiled kernel (prefill_attention.cpp) over `batch` sequences, q [rows, H, D] already
// scaled: the deterministic mode's attention for decode and prefill rows alike. A row's result
// depends only on its position and the stored K/V it reads (every position from the pages), so
// it is the same bits as a decode row, in any chunk, or after a prefix hit.
void tiled_attention(const Decoder& dec, const Layer& L, const float* q, int64_t rows,
                     const int32_t* page_table, int64_t max_pages, const int32_t* seq_lens,
                     const int32_t* query_lens, int64_t batch, float* out) {
  (void)rows;
  PrefillInputs in{q, dec.config.num_heads, dec.config.head_dim, page_table, max_pages, seq_lens,
                   query_lens, batch, 1.f, nullptr, nullptr, dec.fp8_table, out};
  prefill_attention(L.k, L.v, in, dec.isa);
}

template <class Ops>
at::Tensor run(const Decoder& dec, const StepInputs& step) {
  const Config& cfg = dec.config;
  const int64_t rows = step.num_tokens, hid = cfg.hidden, d = cfg.head_dim;
  const int64_t q_size = cfg.num_heads * d, qkv_size = q_size + 2 * cfg.num_kv_heads * d;
  at::Tensor out = at::empty({rows, hid}, at::TensorOptions().dtype(at::kFloat));
  std::vector<float> x(rows * hid);
  Buffers& buf = buffers_for(cfg, rows);
  if (step.embeddings != nullptr) {
    std::memcpy(x.data(), step.embeddings, rows * hid * sizeof(float));
  } else {
    const float* embed = dec.embed.data_ptr<float>();
    for (int64_t t = 0; t < rows; ++t)
      std::memcpy(&x[t * hid], embed + step.token_ids[t] * hid, hid * sizeof(float));
  }
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const std::vector<int32_t> ones(dec.tiled_attention ? rows : 0, 1);  // one query per sequence
  for (const Layer& L : dec.layers) {
    layer_qkv<Ops>(dec, L, x.data(), rows, step.positions, step.slot_pages, step.slot_offsets,
                   buf.h.data(), buf.qkv.data(), buf.quantized);
    // The scaled queries as [M, H, D] (they lead each qkv row).
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t i = 0; i < q_size; ++i) buf.q[t * q_size + i] = buf.qkv[t * qkv_size + i] * scale;
    if (dec.tiled_attention) {
      tiled_attention(dec, L, buf.q.data(), rows, step.page_table, step.max_pages, step.seq_lens,
                      ones.data(), rows, buf.attn.data());
    } else {
      decode_attention<Ops>(cfg, L.k, L.v, buf.q.data(), step.page_table, step.max_pages,
                            step.seq_lens, rows, dec.fp8_table, buf.scratch, buf.attn.data());
    }
    layer_mlp<Ops>(dec, L, buf.attn.data(), rows, x.data(), buf.h.data(), buf.proj.data(),
                   buf.gu.data(), buf.act.data(), buf.quantized);
  }
  rmsnorm_rows<Ops>(x.data(), dec.final_norm, out.data_ptr<float>(), rows, hid, cfg.eps);
  return out;
}

template <class Ops>
at::Tensor run_qkv(const Decoder& dec, int64_t layer, at::Tensor& x, const int64_t* positions,
                   const int64_t* slot_pages, const int64_t* slot_offsets) {
  const Config& cfg = dec.config;
  const int64_t rows = x.size(0);
  Buffers& buf = buffers_for(cfg, rows);
  at::Tensor qkv = at::empty({rows, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim},
                             at::TensorOptions().dtype(at::kFloat));
  layer_qkv<Ops>(dec, dec.layers[layer], x.data_ptr<float>(), rows, positions, slot_pages,
                 slot_offsets, buf.h.data(), qkv.data_ptr<float>(), buf.quantized);
  return qkv;
}

// The fused step's decode attention for any rows: row t attends to the first seq_lens[t]
// positions of page_table row t, its queries scaled as `run` scales them. Prefill rows given
// this way (one row per prompt position) compute exactly what a decode row at that position
// computes: the deterministic mode's prefill attention.
template <class Ops>
at::Tensor run_attend(const Decoder& dec, int64_t layer, const at::Tensor& qkv,
                      const int32_t* page_table, int64_t max_pages, const int32_t* seq_lens) {
  const Config& cfg = dec.config;
  const int64_t rows = qkv.size(0), d = cfg.head_dim;
  const int64_t q_size = cfg.num_heads * d, qkv_size = q_size + 2 * cfg.num_kv_heads * d;
  Buffers& buf = buffers_for(cfg, rows);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const float* in = qkv.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < q_size; ++i) buf.q[t * q_size + i] = in[t * qkv_size + i] * scale;
  at::Tensor out = at::empty({rows, q_size}, at::TensorOptions().dtype(at::kFloat));
  const Layer& L = dec.layers[layer];
  decode_attention<Ops>(cfg, L.k, L.v, buf.q.data(), page_table, max_pages, seq_lens, rows,
                        dec.fp8_table, buf.scratch, out.data_ptr<float>());
  return out;
}

// Deterministic prefill and mixed steps: the step's sequences (decode rows with query_len 1,
// prefill chunks) through the tiled kernel, queries scaled as `run` scales them.
at::Tensor run_attend_tiled(const Decoder& dec, int64_t layer, const at::Tensor& qkv,
                            const int32_t* page_table, int64_t max_pages, const int32_t* seq_lens,
                            const int32_t* query_lens, int64_t batch) {
  const Config& cfg = dec.config;
  const int64_t rows = qkv.size(0), d = cfg.head_dim;
  const int64_t q_size = cfg.num_heads * d, qkv_size = q_size + 2 * cfg.num_kv_heads * d;
  Buffers& buf = buffers_for(cfg, rows);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const float* in = qkv.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < q_size; ++i) buf.q[t * q_size + i] = in[t * qkv_size + i] * scale;
  at::Tensor out = at::empty({rows, q_size}, at::TensorOptions().dtype(at::kFloat));
  tiled_attention(dec, dec.layers[layer], buf.q.data(), rows, page_table, max_pages, seq_lens,
                  query_lens, batch, out.data_ptr<float>());
  return out;
}

template <class Ops>
void run_mlp(const Decoder& dec, int64_t layer, const at::Tensor& attn, at::Tensor& x) {
  const int64_t rows = x.size(0);
  Buffers& buf = buffers_for(dec.config, rows);
  layer_mlp<Ops>(dec, dec.layers[layer], attn.data_ptr<float>(), rows, x.data_ptr<float>(),
                 buf.h.data(), buf.proj.data(), buf.gu.data(), buf.act.data(), buf.quantized);
}

template <class Ops>
at::Tensor run_final_norm(const Decoder& dec, const at::Tensor& x) {
  at::Tensor out = at::empty_like(x);
  rmsnorm_rows<Ops>(x.data_ptr<float>(), dec.final_norm, out.data_ptr<float>(), x.size(0),
                    dec.config.hidden, dec.config.eps);
  return out;
}

}  // namespace

// How many page-aligned parts each (sequence, kv head)'s context is cut into, so that the
// threads finish together: the time of a step is about ceil(items * s / threads) / s head-
// contexts, so with 3 kv heads on 2 threads s = 2 gives 1.5 instead of 2. A part shorter than
// kMinSplitTokens costs more in merging than it saves, which bounds s.
int64_t context_splits(int64_t items, int64_t threads, int64_t longest) {
  const int64_t most = std::min<int64_t>(longest / kMinSplitTokens, 2 * threads);
  int64_t best = 1;
  double best_cost = static_cast<double>((items + threads - 1) / threads);
  for (int64_t s = 2; s <= most; ++s) {
    const double cost = static_cast<double>((items * s + threads - 1) / threads) / s;
    if (cost < best_cost - 1e-9) best = s, best_cost = cost;
  }
  return best;
}

at::Tensor Decoder::forward(const StepInputs& step) const {
  TORCH_CHECK(config.head_dim <= kMaxHeadDim, "head_dim above ", kMaxHeadDim);
  TORCH_CHECK(config.num_heads / config.num_kv_heads <= kMaxGroup, "GQA group above ", kMaxGroup);
  if (isa == Isa::kAvx512Vnni) return run<Avx512>(*this, step);
  return run<Avx2>(*this, step);
}

at::Tensor Decoder::qkv(int64_t layer, at::Tensor& x, const int64_t* positions,
                        const int64_t* slot_pages, const int64_t* slot_offsets) const {
  if (isa == Isa::kAvx512Vnni)
    return run_qkv<Avx512>(*this, layer, x, positions, slot_pages, slot_offsets);
  return run_qkv<Avx2>(*this, layer, x, positions, slot_pages, slot_offsets);
}

at::Tensor Decoder::attend(int64_t layer, const at::Tensor& qkv, const int32_t* page_table,
                          int64_t max_pages, const int32_t* seq_lens) const {
  TORCH_CHECK(config.head_dim <= kMaxHeadDim, "head_dim above ", kMaxHeadDim);
  TORCH_CHECK(config.num_heads / config.num_kv_heads <= kMaxGroup, "GQA group above ", kMaxGroup);
  if (isa == Isa::kAvx512Vnni)
    return run_attend<Avx512>(*this, layer, qkv, page_table, max_pages, seq_lens);
  return run_attend<Avx2>(*this, layer, qkv, page_table, max_pages, seq_lens);
}

at::Tensor Decoder::attend_tiled(int64_t layer, const at::Tensor& qkv, const int32_t* page_table,
                                 int64_t max_pages, const int32_t* seq_lens,
                                 const int32_t* query_lens, int64_t batch) const {
  return run_attend_tiled(*this, layer, qkv, page_table, max_pages, seq_lens, query_lens, batch);
}

void Decoder::mlp(int64_t layer, const at::Tensor& attn, at::Tensor& x) const {
  if (isa == Isa::kAvx512Vnni) return run_mlp<Avx512>(*this, layer, attn, x);
  run_mlp<Avx2>(*this, layer, attn, x);
}

at::Tensor Decoder::final(const at::Tensor& x) const {
  if (isa == Isa::kAvx512Vnni) return run_final_norm<Avx512>(*this, x);
  return run_final_norm<Avx2>(*this, x);
}

}  // namespace densa
