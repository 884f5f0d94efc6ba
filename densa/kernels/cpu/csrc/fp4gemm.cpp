// FP4 (E2M1) weights with block scales, times int8 activations: MXFP4A8 and NVFP4A8, in the
// panel layout and through the dispatch of qgemm.cpp (quantized_linear_raw), so the fused
// decode step runs them like any packed format.
//
// Arithmetic. An e2m1 code's value v is one of 0, +-0.5, 1, 1.5, 2, 3, 4, 6, so 2v is an
// integer in -12..12: a 16-entry byte table (vpshufb) turns a nibble into u = 2v + 12, an
// unsigned byte the int8 dot instructions take, and the surplus 12 * sum(qx) is taken off in
// integers (as W6's offset, qgemm.cpp). Per group of 32 inputs, x ~ dx qx as for every format:
//
//   MXFP4: w = v * 2^(s - 127)           y += dx * 2^(s - 128) * (sum_k u qx - 12 sum_k qx)
//   NVFP4: w = v * e4m3(s_h) * t[n]      y += dx * e4m3(s_h) / 2 * (the same, per half h of
//          16 inputs),  then y[., n] *= t[n] once the panels are done (apply_tensor_scales)
//
// The integer sums are exact; the float part rounds as W4's does, so kernel and the float64
// reference (qgemm.py) differ only by float32 rounding. An E8M0 scale 0xFF is NaN (the whole
// block is NaN, as the OCP spec says) and 0x00 is 2^-127, a float32 subnormal: both exact here.
//
// Layout: W4's nibble layout (qgemm.cpp: byte [64 o + 4 r + j] holds k = 8 o + j low and
// k = 8 o + 4 + j high, for the block's 16 rows r), then the scales:
//   MXFP4 block (272 B): 4 x 64 B nibbles | 16 x E8M0 (row r at 256 + r)
//   NVFP4 block (288 B): 4 x 64 B nibbles | 32 x e4m3 (half h, row r at 256 + 16 h + r)
//   an NVFP4 weight: every panel's blocks, then t[n] as N float32 (4 bytes per row).
// 4.25 and 4.5 bits per weight, the checkpoints' own sizes.
//
// Weight-only (MXFP4, NVFP4: float32 activations, nothing rounded but the float32 sums): the
// same blocks; the table gives signed 2v bytes, each 32-bit lane's byte j (input 8 o + j, or
// 8 o + 4 + j for the high nibbles) is widened to a float lane by shifts, and multiplied by the
// token's x in that input: y = sum_g scale_g / 2 * sum_k 2v x, in float32.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "qgemm.h"
#include "vec.h"

namespace densa {
namespace {

#define DENSA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#define DENSA_AVX2 __attribute__((target("avx2,fma,f16c")))

constexpr int kFp4Offset = 12;  // u = 2 v + 12
// u by code: codes 0..7 are +v, 8..15 the same magnitudes negative (8 is -0).
alignas(16) constexpr uint8_t kFp4Lut[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                             12, 11, 10, 9,  8,  6,  4,  0};
// 2v as signed bytes, for the weight-only kernels.
alignas(16) constexpr int8_t kFp4SignedLut[16] = {0, 1,  2,  3,  4,  6,  8,  12,
                                                  0, -1, -2, -3, -4, -6, -8, -12};
constexpr int kScales = 256;  // byte offset of the scales within a block
constexpr uint32_t kNanBits = 0x7FC00000u;

// ---- scales ------------------------------------------------------------------------------------
// E8M0 s -> 2^(s - 128) (half the scale: the table holds 2v), exactly: s >= 2 is the float
// exponent s - 1; s = 1 and 0 are the subnormals 2^-127 and 2^-128; 255 is NaN.
DENSA_AVX512 inline __m512 e8m0_half_avx512(__m128i bytes) {
  const __m512i s = _mm512_cvtepu8_epi32(bytes), one = _mm512_set1_epi32(1);
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(s, one), 23);
  const __m512i small = _mm512_srlv_epi32(_mm512_set1_epi32(0x00400000), _mm512_sub_epi32(one, s));
  __m512i bits = _mm512_mask_mov_epi32(normal, _mm512_cmplt_epu32_mask(s, _mm512_set1_epi32(2)),
                                       small);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(s, _mm512_set1_epi32(0xFF)),
                               _mm512_set1_epi32(kNanBits));
  return _mm512_castsi512_ps(bits);
}

DENSA_AVX2 inline __m256 e8m0_half_avx2(const uint8_t* bytes) {
  const __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(s, one), 23);
  const __m256i small = _mm256_srlv_epi32(_mm256_set1_epi32(0x00400000), _mm256_sub_epi32(one, s));
  __m256i bits = _mm256_blendv_epi8(normal, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), s));
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(kNanBits),
                            _mm256_cmpeq_epi32(s, _mm256_set1_epi32(0xFF)));
  return _mm256_castsi256_ps(bits);
}

// e4m3 bytes -> half their value (the table holds 2v); S.1111.111 is NaN.
DENSA_AVX512 inline __m512 e4m3_half_avx512(__m128i bytes) {
  const __m512i codes = _mm512_cvtepu8_epi32(bytes);
  const __m512 value = _mm512_mul_ps(Avx512::e4m3_to_float(codes), _mm512_set1_ps(0.5f));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(codes, _mm512_set1_epi32(0x7F)),
                                                _mm512_set1_epi32(0x7F));
  return _mm512_mask_mov_ps(value, nan, _mm512_castsi512_ps(_mm512_set1_epi32(kNanBits)));
}

DENSA_AVX2 inline __m256 e4m3_half_avx2(const uint8_t* bytes) {
  const __m256i codes =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  const __m256 value = _mm256_mul_ps(Avx2::e4m3_to_float(codes), _mm256_set1_ps(0.5f));
  const __m256i nan = _mm256_cmpeq_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(0x7F)),
                                         _mm256_set1_epi32(0x7F));
  return _mm256_blendv_ps(value, _mm256_castsi256_ps(_mm256_set1_epi32(kNanBits)),
                          _mm256_castsi256_ps(nan));
}

// ---- AVX-512 VNNI ------------------------------------------------------------------------------
// acc[t] += the dots of nibble vector o's codes (as u) with token t's 8 inputs of it.
template <int T>
DENSA_AVX512 inline void fp4_dot_avx512(const uint8_t* blk, int o, const int8_t* xq, int64_t cols,
                                        __m512i lut, __m512i* acci) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(blk + 64 * o);
  const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, low4));
  const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
  for (int t = 0; t < T; ++t) {
    int32_t a, b;
    std::memcpy(&a, xq + t * cols + 8 * o, 4);
    std::memcpy(&b, xq + t * cols + 8 * o + 4, 4);
    acci[t] = _mm512_dpbusd_epi32(acci[t], lo, _mm512_set1_epi32(a));
    acci[t] = _mm512_dpbusd_epi32(acci[t], hi, _mm512_set1_epi32(b));
  }
}

template <int T>
DENSA_AVX512 void mxfp4_panel_avx512(const uint8_t* blocks, int64_t groups, const int8_t* qx,
                                     const float* dx, const int32_t* sumq, int64_t cols, float* y,
                                     int64_t ldy) {
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)kFp4Lut));
  __m512 accf[T];
  for (int t = 0; t < T; ++t) accf[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = blocks + g * kMxfp4Block;
    prefetch_weights(blk, kMxfp4Block);
    __m512i acci[T];
    for (int t = 0; t < T; ++t) acci[t] = _mm512_set1_epi32(-kFp4Offset * sumq[t * groups + g]);
    for (int o = 0; o < 4; ++o) fp4_dot_avx512<T>(blk, o, qx + g * kGroup, cols, lut, acci);
    const __m512 d = e8m0_half_avx512(_mm_loadu_si128((const __m128i*)(blk + kScales)));
    for (int t = 0; t < T; ++t) {
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[t * groups + g]));
      accf[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acci[t]), scale, accf[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + t * ldy, accf[t]);
}

template <int T>
DENSA_AVX512 void nvfp4_panel_avx512(const uint8_t* blocks, int64_t groups, const int8_t* qx,
                                     const float* dx, const int32_t* sumh, int64_t cols, float* y,
                                     int64_t ldy) {
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)kFp4Lut));
  __m512 accf[T];
  for (int t = 0; t < T; ++t) accf[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = blocks + g * kNvfp4Block;
    prefetch_weights(blk, kNvfp4Block);
    for (int h = 0; h < 2; ++h) {  // each 16 inputs have their own scale
      __m512i acci[T];
      for (int t = 0; t < T; ++t)
        acci[t] = _mm512_set1_epi32(-kFp4Offset * sumh[2 * (t * groups + g) + h]);
      fp4_dot_avx512<T>(blk, 2 * h, qx + g * kGroup, cols, lut, acci);
      fp4_dot_avx512<T>(blk, 2 * h + 1, qx + g * kGroup, cols, lut, acci);
      const __m512 s = e4m3_half_avx512(_mm_loadu_si128((const __m128i*)(blk + kScales + 16 * h)));
      for (int t = 0; t < T; ++t) {
        const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(dx[t * groups + g]));
        accf[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acci[t]), scale, accf[t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + t * ldy, accf[t]);
}

// ---- AVX2 --------------------------------------------------------------------------------------
// One 8-row side of a panel at a time (the 32-byte halves of each 64-byte vector), as W4's AVX2
// kernel. The two nibbles' u8 x s8 pairs are added as int16 before widening: each pair is at
// most 2 * 24 * 127, their sum 12192, no saturation.
template <int T>
DENSA_AVX2 inline void fp4_dot_avx2(const uint8_t* blk, int o, int side, const int8_t* xq,
                                    int64_t cols, __m256i lut, __m256i* acci) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 64 * o + 32 * side));
  const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, low4));
  const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
  for (int t = 0; t < T; ++t) {
    int32_t a, b;
    std::memcpy(&a, xq + t * cols + 8 * o, 4);
    std::memcpy(&b, xq + t * cols + 8 * o + 4, 4);
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)),
                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(b)));
    acci[t] = _mm256_add_epi32(acci[t], _mm256_madd_epi16(pairs, ones));
  }
}

template <int T>
DENSA_AVX2 void mxfp4_panel_avx2(const uint8_t* blocks, int64_t groups, const int8_t* qx,
                                 const float* dx, const int32_t* sumq, int64_t cols, float* y,
                                 int64_t ldy) {
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)kFp4Lut));
  for (int side = 0; side < 2; ++side) {
    __m256 accf[T];
    for (int t = 0; t < T; ++t) accf[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* blk = blocks + g * kMxfp4Block;
      if (side == 0) prefetch_weights(blk, kMxfp4Block);
      __m256i acci[T];
      for (int t = 0; t < T; ++t) acci[t] = _mm256_set1_epi32(-kFp4Offset * sumq[t * groups + g]);
      for (int o = 0; o < 4; ++o) fp4_dot_avx2<T>(blk, o, side, qx + g * kGroup, cols, lut, acci);
      const __m256 d = e8m0_half_avx2(blk + kScales + 8 * side);
      for (int t = 0; t < T; ++t) {
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[t * groups + g]));
        accf[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[t]), scale, accf[t]);
      }
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(y + t * ldy + 8 * side, accf[t]);
  }
}

template <int T>
DENSA_AVX2 void nvfp4_panel_avx2(const uint8_t* blocks, int64_t groups, const int8_t* qx,
                                 const float* dx, const int32_t* sumh, int64_t cols, float* y,
                                 int64_t ldy) {
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)kFp4Lut));
  for (int side = 0; side < 2; ++side) {
    __m256 accf[T];
    for (int t = 0; t < T; ++t) accf[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* blk = blocks + g * kNvfp4Block;
      if (side == 0) prefetch_weights(blk, kNvfp4Block);
      for (int h = 0; h < 2; ++h) {
        __m256i acci[T];
        for (int t = 0; t < T; ++t)
          acci[t] = _mm256_set1_epi32(-kFp4Offset * sumh[2 * (t * groups + g) + h]);
        fp4_dot_avx2<T>(blk, 2 * h, side, qx + g * kGroup, cols, lut, acci);
        fp4_dot_avx2<T>(blk, 2 * h + 1, side, qx + g * kGroup, cols, lut, acci);
        const __m256 s = e4m3_half_avx2(blk + kScales + 16 * h + 8 * side);
        for (int t = 0; t < T; ++t) {
          const __m256 scale = _mm256_mul_ps(s, _mm256_set1_ps(dx[t * groups + g]));
          accf[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[t]), scale, accf[t]);
        }
      }
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(y + t * ldy + 8 * side, accf[t]);
  }
}

// ---- weight-only (float32 activations) -------------------------------------------------------
// Byte J of every 32-bit lane, sign-extended, as float lanes.
template <int J>
DENSA_AVX512 inline __m512 lane_byte_avx512(__m512i v) {
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * J), 24));
}

// acc[t] += the 16 rows' weights (2v) of nibble vector o times token t's 8 inputs of it.
template <int T, int J>
DENSA_AVX512 inline void float_dot_j_avx512(__m512i lo, __m512i hi, const float* xk,
                                            int64_t cols, __m512* acc) {
  const __m512 wl = lane_byte_avx512<J>(lo), wh = lane_byte_avx512<J>(hi);
  for (int t = 0; t < T; ++t) {
    acc[t] = _mm512_fmadd_ps(wl, _mm512_set1_ps(xk[t * cols + J]), acc[t]);
    acc[t] = _mm512_fmadd_ps(wh, _mm512_set1_ps(xk[t * cols + 4 + J]), acc[t]);
  }
}

template <int T>
DENSA_AVX512 inline void float_dot_avx512(const uint8_t* blk, int o, const float* xg,
                                          int64_t cols, __m512i lut, __m512* acc) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(blk + 64 * o);
  const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, low4));
  const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
  const float* xk = xg + 8 * o;
  float_dot_j_avx512<T, 0>(lo, hi, xk, cols, acc);
  float_dot_j_avx512<T, 1>(lo, hi, xk, cols, acc);
  float_dot_j_avx512<T, 2>(lo, hi, xk, cols, acc);
  float_dot_j_avx512<T, 3>(lo, hi, xk, cols, acc);
}

template <int T, bool kNv>
DENSA_AVX512 void fp4float_panel_avx512(const uint8_t* blocks, int64_t groups, const float* x,
                                        int64_t cols, float* y, int64_t ldy) {
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)kFp4SignedLut));
  constexpr int64_t block = kNv ? kNvfp4Block : kMxfp4Block;
  __m512 accf[T];
  for (int t = 0; t < T; ++t) accf[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = blocks + g * block;
    prefetch_weights(blk, block);
    const float* xg = x + g * kGroup;
    for (int h = 0; h < (kNv ? 2 : 1); ++h) {  // NVFP4: each 16 inputs have their own scale
      __m512 acc[T];
      for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
      for (int o = kNv ? 2 * h : 0; o < (kNv ? 2 * h + 2 : 4); ++o)
        float_dot_avx512<T>(blk, o, xg, cols, lut, acc);
      const __m128i sb = _mm_loadu_si128((const __m128i*)(blk + kScales + 16 * h));
      const __m512 scale = kNv ? e4m3_half_avx512(sb) : e8m0_half_avx512(sb);
      for (int t = 0; t < T; ++t) accf[t] = _mm512_fmadd_ps(acc[t], scale, accf[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + t * ldy, accf[t]);
}

template <int J>
DENSA_AVX2 inline __m256 lane_byte_avx2(__m256i v) {
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * J), 24));
}

template <int T, int J>
DENSA_AVX2 inline void float_dot_j_avx2(__m256i lo, __m256i hi, const float* xk, int64_t cols,
                                        __m256* acc) {
  const __m256 wl = lane_byte_avx2<J>(lo), wh = lane_byte_avx2<J>(hi);
  for (int t = 0; t < T; ++t) {
    acc[t] = _mm256_fmadd_ps(wl, _mm256_set1_ps(xk[t * cols + J]), acc[t]);
    acc[t] = _mm256_fmadd_ps(wh, _mm256_set1_ps(xk[t * cols + 4 + J]), acc[t]);
  }
}

template <int T>
DENSA_AVX2 inline void float_dot_avx2(const uint8_t* blk, int o, int side, const float* xg,
                                      int64_t cols, __m256i lut, __m256* acc) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 64 * o + 32 * side));
  const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, low4));
  const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
  const float* xk = xg + 8 * o;
  float_dot_j_avx2<T, 0>(lo, hi, xk, cols, acc);
  float_dot_j_avx2<T, 1>(lo, hi, xk, cols, acc);
  float_dot_j_avx2<T, 2>(lo, hi, xk, cols, acc);
  float_dot_j_avx2<T, 3>(lo, hi, xk, cols, acc);
}

template <int T, bool kNv>
DENSA_AVX2 void fp4float_panel_avx2(const uint8_t* blocks, int64_t groups, const float* x,
                                    int64_t cols, float* y, int64_t ldy) {
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)kFp4SignedLut));
  constexpr int64_t block = kNv ? kNvfp4Block : kMxfp4Block;
  for (int side = 0; side < 2; ++side) {
    __m256 accf[T];
    for (int t = 0; t < T; ++t) accf[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* blk = blocks + g * block;
      if (side == 0) prefetch_weights(blk, block);
      const float* xg = x + g * kGroup;
      for (int h = 0; h < (kNv ? 2 : 1); ++h) {
        __m256 acc[T];
        for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
        for (int o = kNv ? 2 * h : 0; o < (kNv ? 2 * h + 2 : 4); ++o)
          float_dot_avx2<T>(blk, o, side, xg, cols, lut, acc);
        const uint8_t* sb = blk + kScales + 16 * h + 8 * side;
        const __m256 scale = kNv ? e4m3_half_avx2(sb) : e8m0_half_avx2(sb);
        for (int t = 0; t < T; ++t) accf[t] = _mm256_fmadd_ps(acc[t], scale, accf[t]);
      }
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(y + t * ldy + 8 * side, accf[t]);
  }
}

using FloatPanelFn = void (*)(const uint8_t*, int64_t, const float*, int64_t, float*, int64_t);

// ---- dispatch ----------------------------------------------------------------------------------
template <int T, bool kNv>
void fp4_avx512(const uint8_t* b, int64_t g, const int8_t* q, const float* d, const void* s,
                int64_t c, float* y, int64_t l) {
  const auto* sums = static_cast<const int32_t*>(s);
  if constexpr (kNv) nvfp4_panel_avx512<T>(b, g, q, d, sums, c, y, l);
  else mxfp4_panel_avx512<T>(b, g, q, d, sums, c, y, l);
}

template <int T, bool kNv>
void fp4_avx2(const uint8_t* b, int64_t g, const int8_t* q, const float* d, const void* s,
              int64_t c, float* y, int64_t l) {
  const auto* sums = static_cast<const int32_t*>(s);
  if constexpr (kNv) nvfp4_panel_avx2<T>(b, g, q, d, sums, c, y, l);
  else mxfp4_panel_avx2<T>(b, g, q, d, sums, c, y, l);
}

template <bool kNv>
Int8PanelKernels kernels(Isa isa) {
  if (isa == Isa::kAvx512Vnni)
    return {{fp4_avx512<1, kNv>, fp4_avx512<2, kNv>, fp4_avx512<3, kNv>, fp4_avx512<4, kNv>,
             fp4_avx512<5, kNv>, fp4_avx512<6, kNv>, fp4_avx512<7, kNv>, fp4_avx512<8, kNv>},
            kInt8TileAvx512};
  return {{fp4_avx2<1, kNv>, fp4_avx2<2, kNv>, fp4_avx2<3, kNv>, fp4_avx2<4, kNv>}, kInt8TileAvx2W4};
}

}  // namespace

Int8PanelKernels fp4_panel_kernels(int bits, Isa isa) {
  return bits == kFormatNvfp4A8 ? kernels<true>(isa) : kernels<false>(isa);
}

void fp4float_linear_raw(const float* x, int64_t rows, int64_t cols, const uint8_t* blocks,
                         int64_t n, int bits, Isa isa, float* y, int64_t ldy) {
  if (rows == 0) return;
  const bool nv = bits == kFormatNvfp4, wide = isa == Isa::kAvx512Vnni;
  const FloatPanelFn avx512[2][8] = {
      {fp4float_panel_avx512<1, false>, fp4float_panel_avx512<2, false>,
       fp4float_panel_avx512<3, false>, fp4float_panel_avx512<4, false>,
       fp4float_panel_avx512<5, false>, fp4float_panel_avx512<6, false>,
       fp4float_panel_avx512<7, false>, fp4float_panel_avx512<8, false>},
      {fp4float_panel_avx512<1, true>, fp4float_panel_avx512<2, true>,
       fp4float_panel_avx512<3, true>, fp4float_panel_avx512<4, true>,
       fp4float_panel_avx512<5, true>, fp4float_panel_avx512<6, true>,
       fp4float_panel_avx512<7, true>, fp4float_panel_avx512<8, true>}};
  const FloatPanelFn avx2[2][4] = {
      {fp4float_panel_avx2<1, false>, fp4float_panel_avx2<2, false>,
       fp4float_panel_avx2<3, false>, fp4float_panel_avx2<4, false>},
      {fp4float_panel_avx2<1, true>, fp4float_panel_avx2<2, true>, fp4float_panel_avx2<3, true>,
       fp4float_panel_avx2<4, true>}};
  const int64_t groups = cols / kGroup, panels = n / kPanel, block = block_bytes(bits);
  const int64_t tile = wide ? kInt8TileAvx512 : kInt8TileAvx2W4;
  const int64_t tiles = (rows + tile - 1) / tile;
  at::parallel_for(0, panels * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t panel = item / tiles, t0 = (item % tiles) * tile;
      const int64_t count = std::min(tile, rows - t0);
      const FloatPanelFn fn = wide ? avx512[nv][count - 1] : avx2[nv][count - 1];
      fn(blocks + panel * groups * block, groups, x + t0 * cols, cols,
         y + t0 * ldy + panel * kPanel, ldy);
    }
  });
  if (nv) apply_tensor_scales(blocks, n, cols, rows, y, ldy);
}

at::Tensor fp4float_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t out_features,
                           int64_t bits, const std::string& isa_name) {
  TORCH_CHECK(is_fp4_float_format(static_cast<int>(bits)), "bits: 43 (MXFP4) or 44 (NVFP4)");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed: uint8");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(cols % kGroup == 0 && out_features % kPanel == 0, "shape does not tile");
  TORCH_CHECK(packed.numel() == packed_bytes(static_cast<int>(bits), out_features, cols),
              "packed weight has the wrong size");
  at::Tensor y = at::empty({rows, out_features}, x.options());
  fp4float_linear_raw(x.data_ptr<float>(), rows, cols, packed.data_ptr<uint8_t>(), out_features,
                      static_cast<int>(bits), parse_isa(isa_name), y.data_ptr<float>(),
                      out_features);
  return y;
}

void apply_tensor_scales(const uint8_t* blocks, int64_t n, int64_t k, int64_t rows, float* y,
                         int64_t ldy) {
  // The trailer starts 4-byte aligned: torch's allocation, then whole 288-byte blocks.
  const auto* scales =
      reinterpret_cast<const float*>(blocks + (n / kPanel) * (k / kGroup) * kNvfp4Block);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t c = 0; c < n; ++c) y[r * ldy + c] *= scales[c];
  });
}

at::Tensor pack_fp4(const at::Tensor& qweight, const at::Tensor& scales,
                    const at::Tensor& tensor_scale, int64_t bits) {
  TORCH_CHECK(is_fp4_format(static_cast<int>(bits)), "bits: 41 (MXFP4) or 42 (NVFP4)");
  const bool nv = bits == kFormatNvfp4A8;
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2, "qweight: [N, K/2] uint8");
  const int64_t rows = qweight.size(0), cols = 2 * qweight.size(1);
  TORCH_CHECK(rows % kPanel == 0 && cols % kGroup == 0, "N % 16 and K % 32 must be 0");
  const int64_t groups = cols / kGroup, panels = rows / kPanel, per_group = nv ? 2 : 1;
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.numel() == rows * groups * per_group,
              nv ? "scales: [N, K/16] uint8 (e4m3 bits)" : "scales: [N, K/32] uint8 (E8M0)");
  TORCH_CHECK(!nv || (tensor_scale.scalar_type() == at::kFloat && tensor_scale.numel() == rows),
              "tensor_scale: [N] float32");
  const int64_t block = nv ? kNvfp4Block : kMxfp4Block;
  at::Tensor out = at::empty({packed_bytes(static_cast<int>(bits), rows, cols)}, qweight.options());
  const at::Tensor q = qweight.contiguous(), s = scales.contiguous();
  const uint8_t* src = q.data_ptr<uint8_t>();
  const uint8_t* scale = s.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t p = idx / groups, g = idx % groups;
      uint8_t* blk = dst + idx * block;
      for (int r = 0; r < kPanel; ++r) {
        const int64_t row = p * kPanel + r;
        const uint8_t* bytes = src + row * (cols / 2) + g * (kGroup / 2);  // 16 bytes, 32 codes
        auto code = [&](int k) { return (bytes[k / 2] >> (4 * (k % 2))) & 0x0F; };
        for (int o = 0; o < 4; ++o)
          for (int j = 0; j < 4; ++j)
            blk[64 * o + 4 * r + j] =
                static_cast<uint8_t>(code(8 * o + j) | (code(8 * o + 4 + j) << 4));
        for (int h = 0; h < per_group; ++h)
          blk[kScales + 16 * h + r] = scale[(row * groups + g) * per_group + h];
      }
    }
  });
  if (nv) {
    const at::Tensor t = tensor_scale.contiguous();
    std::memcpy(dst + panels * groups * block, t.data_ptr<float>(), 4 * rows);
  }
  return out;
}

}  // namespace densa
