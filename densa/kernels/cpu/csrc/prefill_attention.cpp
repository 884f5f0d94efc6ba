// Chunked-prefill attention tiled over pages (flash-style), for every KV format the fused
// decoder reads. Why not one SDPA call over the gathered context (what ran before): at 32k
// tokens that gathers and widens the whole context per layer and materializes (or streams
// through torch's math path) a [heads, chunk, context] score matrix, memory that grows with the
// context; here each thread holds one tile (<= 96 query lanes x 64 keys) and its output.
//
// Work: (sequence, kv head, tile of query rows) items, R rows x G query heads of the kv head per
// tile (R * G <= 96 lanes on AVX-512, 48 on AVX2), assigned to threads longest-first (each
// item's cost is its keys x lanes), so the causal triangle of a first chunk balances too.
// Per item: key blocks of kFlashKeyBlock positions from position 0, each widened to float32
// once (K and V), scores by a register-tiled micro-kernel, online softmax, values likewise
// (prefill_attention_body.inc, included once per code path).
#include "prefill_attention.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "vec.h"

namespace densa {
namespace {

struct Tile {
  int64_t seq, head;
  int64_t first_row;      // the sequence's first row in q / out
  int64_t context_start;  // position of the sequence's first query row
  int64_t row0, row1;     // the tile's query rows [row0, row1) of the sequence
};

inline float kv_row_scale(const KVSide& side, int64_t row) {
  if (side.row_scales != nullptr)
    return static_cast<float>(c10::Half(side.row_scales[row], c10::Half::from_bits()));
  return side.exponents ? std::ldexp(1.f, side.exponents[row]) : side.static_scale;
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
namespace flash_avx512 {
using Vec = __m512;
constexpr int kLanes = 16, kKeyRows = 4, kMaxVecs = 6;  // 4 x 6 accumulators of 32 registers
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec x) { _mm512_storeu_ps(p, x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vexp(Vec x) { return Avx512::exp(x); }
inline Vec vwhere_gt(Vec a, Vec b, Vec x, Vec y) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), x, y);
}
inline void widen_row(const void* src, int dtype, int n, float scale, const float* table,
                      float* out) {
  Avx512::widen(src, dtype, n, scale, table, out);
}
#include "prefill_attention_body.inc"
}  // namespace flash_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace flash_avx2 {
using Vec = __m256;
constexpr int kLanes = 8, kKeyRows = 2, kMaxVecs = 6;  // 2 x 6 accumulators of 16 registers
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec x) { _mm256_storeu_ps(p, x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vexp(Vec x) { return Avx2::exp(x); }
inline Vec vwhere_gt(Vec a, Vec b, Vec x, Vec y) {
  return _mm256_blendv_ps(x, y, _mm256_cmp_ps(a, b, _CMP_GT_OQ));
}
inline void widen_row(const void* src, int dtype, int n, float scale, const float* table,
                      float* out) {
  Avx2::widen(src, dtype, n, scale, table, out);
}
#include "prefill_attention_body.inc"
}  // namespace flash_avx2
#pragma GCC pop_options

namespace {

// Tiles of at most `max_lanes` query lanes (rows x heads of one kv head), dealt to `threads`
// threads longest-first, each to the least loaded so far (ties: the lowest thread). A tile's
// cost is its lanes x the keys its last row reads.
std::vector<std::vector<Tile>> plan_tiles(const PrefillInputs& in, int64_t num_kv_heads,
                                          int64_t max_lanes, int64_t threads) {
  const int64_t g_count = in.num_heads / num_kv_heads;
  const int64_t rows_per_tile = std::max<int64_t>(1, max_lanes / g_count);
  std::vector<Tile> tiles;
  std::vector<double> cost;
  int64_t first_row = 0;
  for (int64_t b = 0; b < in.batch; ++b) {
    const int64_t q_len = in.query_lens[b], start = in.seq_lens[b] - q_len;
    for (int64_t r0 = 0; r0 < q_len; r0 += rows_per_tile) {
      const int64_t r1 = std::min(q_len, r0 + rows_per_tile);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        tiles.push_back({b, h, first_row, start, r0, r1});
        cost.push_back(static_cast<double>((r1 - r0) * (start + r1)));
      }
    }
    first_row += q_len;
  }
  std::vector<size_t> order(tiles.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  std::vector<std::vector<Tile>> per_thread(threads);
  std::vector<double> load(threads, 0.0);
  for (size_t i : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    per_thread[t].push_back(tiles[i]);
    load[t] += cost[i];
  }
  return per_thread;
}

}  // namespace

void prefill_attention(const KVSide& k, const KVSide& v, const PrefillInputs& in, Isa isa) {
  TORCH_CHECK(in.head_dim % 4 == 0, "prefill attention: head_dim must be a multiple of 4");
  TORCH_CHECK(in.num_heads % k.num_kv_heads == 0, "prefill attention: heads per kv head");
  // A tile holds one kv head's query heads for at least one row: more than its lanes would
  // overrun the accumulators (the Python side sends such models to the torch path).
  const int64_t max_lanes = isa == Isa::kAvx512Vnni ? flash_avx512::kMaxVecs * flash_avx512::kLanes
                                                    : flash_avx2::kMaxVecs * flash_avx2::kLanes;
  TORCH_CHECK(in.num_heads / k.num_kv_heads <= max_lanes, "prefill attention: more than ",
              max_lanes, " query heads per kv head");
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  if (isa == Isa::kAvx512Vnni) {
    using namespace flash_avx512;
    flash_avx512::run_tiles(k, v, in, plan_tiles(in, k.num_kv_heads, kMaxVecs * kLanes, threads));
  } else {
    using namespace flash_avx2;
    flash_avx2::run_tiles(k, v, in, plan_tiles(in, k.num_kv_heads, kMaxVecs * kLanes, threads));
  }
}

}  // namespace densa
