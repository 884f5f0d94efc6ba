// Weight-only 8-bit matmul: y[M, N] = x[M, K] W[N, K]^T with W in Q8_0 groups (int8 codes, one
// fp16 scale per 32 inputs) and x in float32, widened in registers: no activation rounding, so
// the result is the float32 product with the stored weights (up to summation order).
//
// Used for the output head (--head-format w8): at decode it streams a quarter of an fp32 head's
// bytes and, unlike w8a8, adds no error to the logits (docs/weights.md).
//
// Block per 16-row panel and group of 32 inputs (544 B): byte [16 k + r] = code of row r at
// input 32 g + k (the 16 rows of one input are one 16-byte vector), then 16 x fp16 d.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "qgemm.h"

namespace densa {
namespace {

constexpr int kCodes = 512;

#define DENSA_W8F_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define DENSA_W8F_AVX2 __attribute__((target("avx2,fma,f16c")))

template <int T>
DENSA_W8F_AVX512 void panel_avx512(const uint8_t* blocks, int64_t groups, const float* x,
                                   int64_t cols, float* y, int64_t ldy) {
  __m512 accf[T];
  for (int t = 0; t < T; ++t) accf[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = blocks + g * kW8Block;
    prefetch_weights(blk, kW8Block);
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int k = 0; k < kGroup; ++k) {
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * k));
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
      for (int t = 0; t < T; ++t)
        acc[t] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[t * cols + g * kGroup + k]), acc[t]);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kCodes)));
    for (int t = 0; t < T; ++t) accf[t] = _mm512_fmadd_ps(acc[t], d, accf[t]);
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + t * ldy, accf[t]);
}

template <int T>
DENSA_W8F_AVX2 void panel_avx2(const uint8_t* blocks, int64_t groups, const float* x, int64_t cols,
                               float* y, int64_t ldy) {
  __m256 accf[T][2];
  for (int t = 0; t < T; ++t) accf[t][0] = accf[t][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = blocks + g * kW8Block;
    prefetch_weights(blk, kW8Block);
    __m256 acc[T][2];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int k = 0; k < kGroup; ++k) {
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * k));
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(codes, 8)));
      for (int t = 0; t < T; ++t) {
        const __m256 xv = _mm256_set1_ps(x[t * cols + g * kGroup + k]);
        acc[t][0] = _mm256_fmadd_ps(lo, xv, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(hi, xv, acc[t][1]);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kCodes + 16 * h)));
      for (int t = 0; t < T; ++t) accf[t][h] = _mm256_fmadd_ps(acc[t][h], d, accf[t][h]);
    }
  }
  for (int t = 0; t < T; ++t) {
    _mm256_storeu_ps(y + t * ldy, accf[t][0]);
    _mm256_storeu_ps(y + t * ldy + 8, accf[t][1]);
  }
}

using PanelFn = void (*)(const uint8_t*, int64_t, const float*, int64_t, float*, int64_t);
constexpr int kTileAvx512 = 8, kTileAvx2 = 3;

}  // namespace

void w8float_linear_raw(const float* x, int64_t rows, int64_t cols, const uint8_t* blocks,
                        int64_t n, Isa isa, float* y, int64_t ldy) {
  if (rows == 0) return;
  const int64_t groups = cols / kGroup, panels = n / kPanel;
  const bool wide = isa == Isa::kAvx512Vnni;
  const PanelFn avx512[] = {panel_avx512<1>, panel_avx512<2>, panel_avx512<3>, panel_avx512<4>,
                            panel_avx512<5>, panel_avx512<6>, panel_avx512<7>, panel_avx512<8>};
  const PanelFn avx2[] = {panel_avx2<1>, panel_avx2<2>, panel_avx2<3>};
  const int64_t tile = wide ? kTileAvx512 : kTileAvx2;
  const int64_t tiles = (rows + tile - 1) / tile;
  at::parallel_for(0, panels * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t panel = item / tiles, t0 = (item % tiles) * tile;
      const int64_t count = std::min(tile, rows - t0);
      const PanelFn fn = wide ? avx512[count - 1] : avx2[count - 1];
      fn(blocks + panel * groups * kW8Block, groups, x + t0 * cols, cols,
         y + t0 * ldy + panel * kPanel, ldy);
    }
  });
}

at::Tensor w8float_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t out_features,
                          const std::string& isa_name) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed: uint8");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(cols % kGroup == 0 && out_features % kPanel == 0, "shape does not tile");
  TORCH_CHECK(packed.numel() == (out_features / kPanel) * (cols / kGroup) * kW8Block,
              "packed weight has the wrong size");
  at::Tensor y = at::empty({rows, out_features}, x.options());
  w8float_linear_raw(x.data_ptr<float>(), rows, cols, packed.data_ptr<uint8_t>(), out_features,
                     parse_isa(isa_name), y.data_ptr<float>(), out_features);
  return y;
}

at::Tensor pack_w8float(const at::Tensor& codes, const at::Tensor& d) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2, "codes: [N, K] int8");
  const int64_t rows = codes.size(0), cols = codes.size(1);
  TORCH_CHECK(rows % kPanel == 0 && cols % kGroup == 0, "N % 16 and K % 32 must be 0");
  const int64_t groups = cols / kGroup, panels = rows / kPanel;
  const at::Tensor c = codes.contiguous();
  const at::Tensor dh = d.to(at::kHalf).contiguous();
  at::Tensor out = at::empty({panels * groups * kW8Block}, codes.options().dtype(at::kByte));
  const int8_t* src = c.data_ptr<int8_t>();
  const uint16_t* dsrc = reinterpret_cast<const uint16_t*>(dh.data_ptr<at::Half>());
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* blk = dst + (p * groups + g) * kW8Block;
      uint16_t* dblk = reinterpret_cast<uint16_t*>(blk + kCodes);
      for (int r = 0; r < kPanel; ++r) {
        const int64_t row = p * kPanel + r;
        for (int k = 0; k < kGroup; ++k)
          blk[16 * k + r] = static_cast<uint8_t>(src[row * cols + g * kGroup + k]);
        dblk[r] = dsrc[row * groups + g];
      }
    }
  }
  return out;
}

}  // namespace densa
