// Quantized matmuls for CPUs: y[M, N] = x[M, K] W[N, K]^T with W in 4-, 6- or 8-bit groups of 32
// input columns and x quantized on the fly to int8 per row and group of 32 ("W4A8" / "W6A8" /
// "W8A8").
//
// Why: a decode step streams every weight once (memory-bound: 4-bit weights read 6.4x fewer bytes
// than fp32), and prefill is compute-bound (an int8 dot-product instruction does 4-16x the
// multiply-adds of an fp32 FMA). The arithmetic is llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0:
//
//   W4:  w[n, k] = d[n, g] * q[n, k] + m[n, g]     q in 0..15, d and m fp16, g = k / 32
//   W8:  w[n, k] = d[n, g] * q[n, k]               q in -127..127, d fp16
//   W6:  w[n, k] = d[n, g] * sc[n, k / 16] * (u[n, k] - 32)     u in 0..63, d fp16, sc int8
//   W6M: w[n, k] = d[n, g] * sc[n, k / 16] * (u[n, k] - 32) + m[n, g]              m fp16
//   x:   x[t, k] ~ dx[t, g] * qx[t, k]            qx in -127..127, dx = max|x| / 127 (fp32)
//   y[t, n] = sum_g dx*d * sum_k q*qx  (+ m * dx * sum_k qx for W4: the quantized x's sum)
//   W6:     sum_g dx*d * sum_{h = 0, 1} sc_h * (sum_{k in half h} u*qx - 32 * sum_{k in h} qx)
//   W6M:    W6's sum + m * dx * sum_k qx per group, as W4
//
// W6 exists to run GGUF files' Q6_K tensors from their exact values (d = the super-block's
// scale, repeated over its 8 groups; sc = the scale of each 16 inputs; u = the 6-bit code);
// Q5_0 (sc = 1, u = q + 16) and Q4_0 (sc = 1, u = q + 24) fit it exactly too. d * sc needs at
// most 11 + 8 significant bits, so it is exact in float32. 7 bits per weight (Q6_K: 6.56).
// W6M adds W4's minimum for the 5-bit types with one: Q5_1 (sc = 1, u = q + 32) exactly, Q5_K
// (sc = its 6-bit scale, m = -dmin * min rounded to fp16). 7.5 bits per weight.
// W5 and W5M are W6 and W6M with one high bit instead of two, for the 5-bit types at 6.0 and
// 6.5 bits per weight (the files: 5.5 to 6.0):
//   W5:  w[n, k] = d[n, g] * sc[n, k / 16] * (u[n, k] - 16)     u in 0..31: Q5_0 (sc = 1),
//                                                                Q3_K (sc = its scale), Q4_0
//   W5M: w[n, k] = d[n, g] * sc[n, k / 16] * u[n, k] + m[n, g]  u in 0..31: Q5_1 and Q5_K as
//                                                                W6M, their codes unshifted
// (a minimum makes the codes unsigned, as the files store them, so W5M has no offset). All four
// are one kernel templated on the format (SplitFormat below), not copies.
//
// Layout: rows are cut into panels of 16; a panel's group is one block, so a matmul streams one
// array front to back. Within a block, 4 consecutive k of one row sit in 4 adjacent bytes (the
// operand layout of the int8 dot instructions: one 32-bit lane = 4 k of one row), 16 rows across
// a 512-bit vector, so every instruction yields 16 output rows and nothing is summed across lanes.
//
//   W4 block (320 B): 4 x 64 B codes | 16 x fp16 d | 16 x fp16 m
//     codes byte [64 o + 4 r + j]: low nibble = q[r, 8 o + j], high nibble = q[r, 8 o + 4 + j]
//   W8 block (544 B): 8 x 64 B codes | 16 x fp16 d
//     codes byte [64 c + 4 r + j] = q[r, 4 c + j] (+128 as u8 for the VNNI path, see below)
//   W6 block (448 B): 4 x 64 B low nibbles | 2 x 64 B high bits | 32 x int8 sc | 16 x fp16 d
//     nibbles [64 o + 4 r + j]: low nibble = u[r, 8 o + j] & 15, high = u[r, 8 o + 4 + j] & 15
//     high bits [256 + 64 p + 4 r + j]: bits 2i..2i+1 = u[r, 16 p + 4 i + j] >> 4   (i = 0..3)
//     sc [384 + 16 h + r] = sc[r, 2 g + h];  d [416 + 2 r]
//   W6M block (480 B): a W6 block | 16 x fp16 m   (m [448 + 2 r])
//   W5 block (384 B):  4 x 64 B low nibbles | 64 B high bits | 32 x int8 sc | 16 x fp16 d
//     high bits [256 + 4 r + j]: bit i = u[r, 4 i + j] >> 4   (i = 0..7)
//     sc [320 + 16 h + r];  d [352 + 2 r]
//   W5M block (416 B): a W5 block | 16 x fp16 m   (m [384 + 2 r])
//   so half h of a group (k = 16 h .. 16 h + 15) is nibble vectors o = 2h, 2h + 1 and high-bit
//   vector p = h: its 6-bit codes are two dot-product operands, as W4's nibbles are:
//
//     k in the group     0..3   4..7   8..11  12..15 | 16..19 20..23 24..27 28..31
//     nibble vector o    0 lo   0 hi   1 lo   1 hi   | 2 lo   2 hi   3 lo   3 hi
//     high bits p, i     0, 0   0, 1   0, 2   0, 3   | 1, 0   1, 1   1, 2   1, 3
//     W5's bit i         0      1      2      3      | 4      5      6      7
//
// Two code paths, chosen at run time from the CPU's flags (and forceable, so tests run both):
//   avx512_vnni: vpdpbusd (u8 x s8 -> s32, 64 multiply-adds per instruction)
//   avx2:        vpmaddubsw + vpmaddwd (u8 x s8 -> s16 pairs -> s32), 256-bit
// vpdpbusd multiplies unsigned by signed bytes. W4 codes are unsigned already. W8 codes are
// stored +128 (unsigned) for VNNI and the surplus 128 * sum(qx) is subtracted per group; the
// avx2 path keeps them signed and uses the sign trick (|w| x sign(x, w)) so vpmaddubsw never
// saturates. W6 codes are unsigned (u = code + 32) on both paths: the 32 * sum(qx) surplus is
// taken off per half group (one int32 sum each, computed once with the activations); W5's
// 16 * sum(qx) likewise.

#include "qgemm.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace densa {

constexpr int kW4Codes = 256;
constexpr int kW8Codes = 512;

// The split formats (W6, W6M, W5, W5M): 4-bit nibbles, then a plane of kHighBits more per code,
// then sc, d and (kMin) m. Code field f of a row (its k = 4 f .. 4 f + 3, f = 0..7) has its
// high bits in plane vector f / kFieldsPerByte at bit kHighBits * (f % kFieldsPerByte).
template <int kHighBits_, bool kMin_>
struct SplitFormat {
  static constexpr int kHighBits = kHighBits_;
  static constexpr bool kMin = kMin_;
  static constexpr int kHigh = 256;  // byte offsets into a block
  static constexpr int kScales = kHigh + 64 * kHighBits;
  static constexpr int kD = kScales + 32;
  static constexpr int kM = kD + 32;  // kMin only
  static constexpr int kBlock = kMin ? kM + 32 : kM;
  static constexpr int kFieldsPerByte = 8 / kHighBits;
  static constexpr int kCodes = 1 << (4 + kHighBits);  // u in 0 .. kCodes - 1
  // u = code + kOffset: signed codes (-32..31, -16..15), except W5M's (0..31, see the header).
  static constexpr int kOffset = kHighBits == 1 && kMin ? 0 : kCodes / 2;
  static constexpr uint8_t kTopMask = ((1 << kHighBits) - 1) << 4;  // the high bits within u
};
using W6 = SplitFormat<2, false>;
using W6M = SplitFormat<2, true>;
using W5 = SplitFormat<1, false>;
using W5M = SplitFormat<1, true>;
static_assert(W6::kBlock == kW6Block && W6M::kBlock == kW6MBlock);
static_assert(W5::kBlock == kW5Block && W5M::kBlock == kW5MBlock);

// How far a code field's high bits move to land on bit 4 (negative: to the right). At most 4
// either way, so 16-bit shifts never carry a wanted bit across a byte.
template <class F>
constexpr int shift_to_bit4(int field) {
  return 4 - F::kHighBits * (field % F::kFieldsPerByte);
}

bool cpu_has_avx512_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

Isa parse_isa(const std::string& name) {
  if (name == "avx512_vnni") {
    TORCH_CHECK(cpu_has_avx512_vnni(), "this CPU has no AVX-512 VNNI");
    return Isa::kAvx512Vnni;
  }
  if (name == "avx2") {
    TORCH_CHECK(cpu_has_avx2(), "this CPU has no AVX2/FMA/F16C");
    return Isa::kAvx2;
  }
  TORCH_CHECK(false, "unknown ISA '", name, "' (avx512_vnni or avx2)");
}

std::string best_isa() {
  if (cpu_has_avx512_vnni()) return "avx512_vnni";
  if (cpu_has_avx2()) return "avx2";
  return "";
}

void ActivationBuffers::ensure(int64_t rows, int64_t cols) {
  const int64_t groups = cols / kGroup;
  if (qx.defined() && qx.numel() >= rows * cols && dx.numel() >= rows * groups) return;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  qx = at::empty({rows * cols}, f32.dtype(at::kChar));
  dx = at::empty({rows * groups}, f32);
  sumx = at::empty({rows * groups}, f32);
  sumq = at::empty({rows * groups}, f32.dtype(at::kInt));
  sumh = at::empty({rows * groups * 2}, f32.dtype(at::kInt));
}

namespace {

// ---- activations -------------------------------------------------------------------------------
// Per row t and group g: qx (int8), dx = max|x| / 127, the integer sum of qx (W8/VNNI's +128
// correction) and dx times it, the sum of the *quantized* x (W4's m term). Using the quantized
// sum makes W4's error sum_k w_k (x^_k - x_k), like W8's; the exact sum of x would leave
// sum_k (w_k - m) (x^_k - x_k), and w - m is a group's offset from its minimum (all >= 0, so
// the rounding errors do not cancel): 3x the KL on SmolLM2 (docs/weights.md). The split
// formats (W5, W6) take the sums of each 16-input half (sumh[0], sumh[1]), since their scales
// change every 16 inputs. One group of 32 per call; the rounding is the CPU's default (to
// nearest, ties to even), as torch.round in the reference.
#define DENSA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#define DENSA_AVX2 __attribute__((target("avx2,fma,f16c")))

DENSA_AVX512 void quantize_group_avx512(const float* v, int8_t* q, float* dx, float* sumx,
                                        int32_t* sumq, int32_t* sumh) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  *dx = d;
  sumh[0] = _mm512_reduce_add_epi32(qa);
  sumh[1] = _mm512_reduce_add_epi32(qb);
  *sumq = sumh[0] + sumh[1];
  *sumx = d * static_cast<float>(*sumq);
}

DENSA_AVX2 void quantize_group_avx2(const float* v, int8_t* q, float* dx, float* sumx,
                                    int32_t* sumq, int32_t* sumh) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[i]));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float m = 0.f;
  for (float lane : lanes) m = std::max(m, lane);
  const float d = m / 127.f;
  const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv));
  // 32 x int32 -> 32 x int8 (packs work within 128-bit lanes; the permute restores order).
  const __m256i w01 = _mm256_packs_epi32(qi[0], qi[1]), w23 = _mm256_packs_epi32(qi[2], qi[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  alignas(32) int32_t sums[2][8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums[0]), _mm256_add_epi32(qi[0], qi[1]));
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums[1]), _mm256_add_epi32(qi[2], qi[3]));
  for (int h = 0; h < 2; ++h) {
    sumh[h] = 0;
    for (int32_t lane : sums[h]) sumh[h] += lane;
  }
  *dx = d;
  *sumq = sumh[0] + sumh[1];
  *sumx = d * static_cast<float>(*sumq);
}

void quantize_activations(const float* src, int64_t rows, int64_t cols, Isa isa,
                          ActivationBuffers& out) {
  const int64_t groups = cols / kGroup;
  const auto one = isa == Isa::kAvx512Vnni ? quantize_group_avx512 : quantize_group_avx2;
  int8_t* qx = out.qx.data_ptr<int8_t>();
  float* dx = out.dx.data_ptr<float>();
  float* sumx = out.sumx.data_ptr<float>();
  int32_t* sumq = out.sumq.data_ptr<int32_t>();
  int32_t* sumh = out.sumh.data_ptr<int32_t>();
  at::parallel_for(0, rows * groups, 512, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t offset = (idx / groups) * cols + (idx % groups) * kGroup;
      one(src + offset, qx + offset, dx + idx, sumx + idx, sumq + idx, sumh + 2 * idx);
    }
  });
}

// ---- AVX-512 VNNI ------------------------------------------------------------------------------

template <int T>
DENSA_AVX512 void w4_panel_avx512(const uint8_t* blocks, int64_t groups, const int8_t* qx,
                                  const float* dx, const float* sumx, int64_t cols, float* y,
                                  int64_t ldy) {
  __m512 accf[T];
  for (int t = 0; t < T; ++t) accf[t] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = blocks + g * kW4Block;
    prefetch_weights(blk, kW4Block);
    __m512i acci[T];
    for (int t = 0; t < T; ++t) acci[t] = _mm512_setzero_si512();
    for (int o = 0; o < 4; ++o) {
      const __m512i v = _mm512_loadu_si512(blk + 64 * o);
      const __m512i lo = _mm512_and_si512(v, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      for (int t = 0; t < T; ++t) {
        const int8_t* xq = qx + t * cols + g * kGroup + 8 * o;
        int32_t a, b;
        std::memcpy(&a, xq, 4);
        std::memcpy(&b, xq + 4, 4);
        acci[t] = _mm512_dpbusd_epi32(acci[t], lo, _mm512_set1_epi32(a));
        acci[t] = _mm512_dpbusd_epi32(acci[t], hi, _mm512_set1_epi32(b));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + kW4Codes)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + kW4Codes + 32)));
    for (int t = 0; t < T; ++t) {
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[t * groups + g]));
      accf[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acci[t]), scale, accf[t]);
      accf[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sumx[t * groups + g]), accf[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + t * ldy, accf[t]);
}

template <int T>
DENSA_AVX512 void w8_panel_avx512(const uint8_t* blocks, int64_t groups, const int8_t* qx,
                                  const float* dx, const int32_t* sumq, int64_t cols, float* y,
                                  int64_t ldy) {
  __m512 accf[T];
  for (int t = 0; t < T; ++t) accf[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = blocks + g * kW8Block;
    prefetch_weights(blk, kW8Block);
    __m512i acci[T];
    for (int t = 0; t < T; ++t) acci[t] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_loadu_si512(blk + 64 * c);  // codes + 128, unsigned
      for (int t = 0; t < T; ++t) {
        int32_t a;
        std::memcpy(&a, qx + t * cols + g * kGroup + 4 * c, 4);
        acci[t] = _mm512_dpbusd_epi32(acci[t], v, _mm512_set1_epi32(a));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + kW8Codes)));
    for (int t = 0; t < T; ++t) {
      // sum (q + 128) qx = sum q qx + 128 sum qx: remove the surplus.
      const __m512i surplus = _mm512_set1_epi32(128 * sumq[t * groups + g]);
      const __m512i dot = _mm512_sub_epi32(acci[t], surplus);
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[t * groups + g]));
      accf[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, accf[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + t * ldy, accf[t]);
}

// The codes of nibble vector o: its nibbles v plus their high bits, from plane vector hb
// (fields 2 o and 2 o + 1, see the layout) moved to bit 4 up. The shifts are 16-bit: bits that
// cross into the neighbouring byte land outside the mask.
template <int kShift>
DENSA_AVX512 inline __m512i to_bit4_avx512(__m512i hb) {
  if constexpr (kShift >= 0) return _mm512_slli_epi16(hb, kShift);
  else return _mm512_srli_epi16(hb, -kShift);
}

template <class F, int o>
DENSA_AVX512 inline void split_codes_avx512(__m512i v, __m512i hb, __m512i* lo, __m512i* hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(F::kTopMask);
  const __m512i top_lo = to_bit4_avx512<shift_to_bit4<F>(2 * o)>(hb);
  const __m512i top_hi = to_bit4_avx512<shift_to_bit4<F>(2 * o + 1)>(hb);
  *lo = _mm512_or_si512(_mm512_and_si512(v, low4), _mm512_and_si512(top_lo, top));
  *hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4),
                        _mm512_and_si512(top_hi, top));
}

// The minimum term of a W6M / W5M group for token t: dx * the sum of its qx, made from the
// halves' sums as quantize_group_* makes W4's sumx (the same float32 product, so the same bits).
inline float split_sumx(const float* dx, const int32_t* sumh, int64_t idx) {
  return dx[idx] * static_cast<float>(sumh[2 * idx] + sumh[2 * idx + 1]);
}

// acc[t] += the dot products of nibble vector o's codes with token t's 8 inputs of it.
template <class F, int o, int T>
DENSA_AVX512 inline void split_dot_avx512(const uint8_t* blk, __m512i hb, const int8_t* xq,
                                          int64_t cols, __m512i* acci) {
  __m512i lo, hi;
  split_codes_avx512<F, o>(_mm512_loadu_si512(blk + 64 * o), hb, &lo, &hi);
  for (int t = 0; t < T; ++t) {
    int32_t a, b;
    std::memcpy(&a, xq + t * cols + 8 * o, 4);
    std::memcpy(&b, xq + t * cols + 8 * o + 4, 4);
    acci[t] = _mm512_dpbusd_epi32(acci[t], lo, _mm512_set1_epi32(a));
    acci[t] = _mm512_dpbusd_epi32(acci[t], hi, _mm512_set1_epi32(b));
  }
}

// Half h of group g (16 inputs: one scale sc) summed on its own, starting from -kOffset times
// the half's sum of qx, so the codes' offset is taken off in integers (exact).
template <class F, int h, int T>
DENSA_AVX512 inline void split_half_avx512(const uint8_t* blk, int64_t groups, int64_t g,
                                           const int8_t* qx, const int32_t* sumh, int64_t cols,
                                           __m512i* acci) {
  for (int t = 0; t < T; ++t)
    acci[t] = _mm512_set1_epi32(-F::kOffset * sumh[2 * (t * groups + g) + h]);
  const __m512i hb = _mm512_loadu_si512(blk + F::kHigh + 64 * (4 * h / F::kFieldsPerByte));
  const int8_t* xq = qx + g * kGroup;
  split_dot_avx512<F, 2 * h, T>(blk, hb, xq, cols, acci);
  split_dot_avx512<F, 2 * h + 1, T>(blk, hb, xq, cols, acci);
}

// One panel of a split format; with a minimum (F::kMin), groups add m times the group's sum of
// x as W4's do.
template <int T, class F>
DENSA_AVX512 void split_panel_avx512(const uint8_t* blocks, int64_t groups, const int8_t* qx,
                                     const float* dx, const int32_t* sumh, int64_t cols, float* y,
                                     int64_t ldy) {
  __m512 accf[T];
  for (int t = 0; t < T; ++t) accf[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = blocks + g * F::kBlock;
    prefetch_weights(blk, F::kBlock);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + F::kD)));
    for (int h = 0; h < 2; ++h) {
      __m512i acci[T];
      if (h == 0) split_half_avx512<F, 0, T>(blk, groups, g, qx, sumh, cols, acci);
      else split_half_avx512<F, 1, T>(blk, groups, g, qx, sumh, cols, acci);
      const __m128i sc = _mm_loadu_si128((const __m128i*)(blk + F::kScales + 16 * h));
      const __m512 ds = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));  // exact
      for (int t = 0; t < T; ++t) {
        const __m512 scale = _mm512_mul_ps(ds, _mm512_set1_ps(dx[t * groups + g]));
        accf[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acci[t]), scale, accf[t]);
      }
    }
    if constexpr (F::kMin) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + F::kM)));
      for (int t = 0; t < T; ++t)
        accf[t] =
            _mm512_fmadd_ps(m, _mm512_set1_ps(split_sumx(dx, sumh, t * groups + g)), accf[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + t * ldy, accf[t]);
}

// ---- AVX2 --------------------------------------------------------------------------------------

// u8 x s8 dot of 4-byte lanes -> s32 (vpmaddubsw pairs, then vpmaddwd with ones).
DENSA_AVX2 inline __m256i dot4_avx2(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// One panel as two halves of 8 rows (ymm), one half at a time so T = 4 tokens fit the 16 ymm
// registers (4 int + 4 float accumulators). The two nibble halves' u8 x s8 products are added
// as int16 before widening (each is at most 2 * 15 * 127, their sum 7620: no saturation), which
// saves one widening multiply-add per pair.
template <int T>
DENSA_AVX2 void w4_panel_avx2(const uint8_t* blocks, int64_t groups, const int8_t* qx,
                              const float* dx, const float* sumx, int64_t cols, float* y,
                              int64_t ldy) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 accf[T];
    for (int t = 0; t < T; ++t) accf[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* blk = blocks + g * kW4Block;
      if (h == 0) prefetch_weights(blk, kW4Block);
      __m256i acci[T];
      for (int t = 0; t < T; ++t) acci[t] = _mm256_setzero_si256();
      for (int o = 0; o < 4; ++o) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 64 * o + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int t = 0; t < T; ++t) {
          const int8_t* xq = qx + t * cols + g * kGroup + 8 * o;
          int32_t a, b;
          std::memcpy(&a, xq, 4);
          std::memcpy(&b, xq + 4, 4);
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(b)));
          acci[t] = _mm256_add_epi32(acci[t], _mm256_madd_epi16(pairs, ones));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + kW4Codes + 16 * h)));
      const __m256 m =
          _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + kW4Codes + 32 + 16 * h)));
      for (int t = 0; t < T; ++t) {
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[t * groups + g]));
        accf[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[t]), scale, accf[t]);
        accf[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(sumx[t * groups + g]), accf[t]);
      }
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(y + t * ldy + 8 * h, accf[t]);
  }
}

template <int T>
DENSA_AVX2 void w8_panel_avx2(const uint8_t* blocks, int64_t groups, const int8_t* qx,
                              const float* dx, const int32_t* /*sumq*/, int64_t cols, float* y,
                              int64_t ldy) {
  __m256 accf[T][2];
  for (int t = 0; t < T; ++t) accf[t][0] = accf[t][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = blocks + g * kW8Block;
    prefetch_weights(blk, kW8Block);
    __m256i acci[T][2];
    for (int t = 0; t < T; ++t) acci[t][0] = acci[t][1] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(blk + 64 * c + 32 * h));  // signed
        const __m256i w_abs = _mm256_sign_epi8(w, w);
        for (int t = 0; t < T; ++t) {
          int32_t a;
          std::memcpy(&a, qx + t * cols + g * kGroup + 4 * c, 4);
          // |w| * (sign(w) x): unsigned x signed, |products| <= 127 * 127, no saturation.
          const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(a), w);
          acci[t][h] = _mm256_add_epi32(acci[t][h], dot4_avx2(w_abs, xs));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + kW8Codes + 16 * h)));
      for (int t = 0; t < T; ++t) {
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[t * groups + g]));
        accf[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[t][h]), scale, accf[t][h]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    _mm256_storeu_ps(y + t * ldy, accf[t][0]);
    _mm256_storeu_ps(y + t * ldy + 8, accf[t][1]);
  }
}

template <int kShift>
DENSA_AVX2 inline __m256i to_bit4_avx2(__m256i hb) {
  if constexpr (kShift >= 0) return _mm256_slli_epi16(hb, kShift);
  else return _mm256_srli_epi16(hb, -kShift);
}

// As split_dot_avx512, for one 8-row side of the panel (the vectors' 32-byte halves at `blk`).
template <class F, int o, int T>
DENSA_AVX2 inline void split_dot_avx2(const uint8_t* blk, __m256i hb, const int8_t* xq,
                                      int64_t cols, __m256i* acci) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(F::kTopMask);
  const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 64 * o));
  const __m256i top_lo = to_bit4_avx2<shift_to_bit4<F>(2 * o)>(hb);
  const __m256i top_hi = to_bit4_avx2<shift_to_bit4<F>(2 * o + 1)>(hb);
  const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(top_lo, top));
  const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                                     _mm256_and_si256(top_hi, top));
  for (int t = 0; t < T; ++t) {
    int32_t a, b;
    std::memcpy(&a, xq + t * cols + 8 * o, 4);
    std::memcpy(&b, xq + t * cols + 8 * o + 4, 4);
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)),
                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(b)));
    acci[t] = _mm256_add_epi32(acci[t], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
}

template <class F, int h, int T>
DENSA_AVX2 inline void split_half_avx2(const uint8_t* blk, int64_t groups, int64_t g,
                                       const int8_t* qx, const int32_t* sumh, int64_t cols,
                                       __m256i* acci) {
  for (int t = 0; t < T; ++t)
    acci[t] = _mm256_set1_epi32(-F::kOffset * sumh[2 * (t * groups + g) + h]);
  const __m256i hb =
      _mm256_loadu_si256((const __m256i*)(blk + F::kHigh + 64 * (4 * h / F::kFieldsPerByte)));
  const int8_t* xq = qx + g * kGroup;
  split_dot_avx2<F, 2 * h, T>(blk, hb, xq, cols, acci);
  split_dot_avx2<F, 2 * h + 1, T>(blk, hb, xq, cols, acci);
}

// As w4_panel_avx2: one 8-row side of the panel at a time, T = 4 tokens. Two products of a
// 6-bit code and an int8 are at most 2 * 63 * 127 per vpmaddubsw lane, and the two nibble
// halves' lanes add to 32004 at most: no int16 saturation (5-bit codes: 15748).
template <int T, class F>
DENSA_AVX2 void split_panel_avx2(const uint8_t* blocks, int64_t groups, const int8_t* qx,
                                 const float* dx, const int32_t* sumh, int64_t cols, float* y,
                                 int64_t ldy) {
  for (int side = 0; side < 2; ++side) {
    __m256 accf[T];
    for (int t = 0; t < T; ++t) accf[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* blk = blocks + g * F::kBlock;
      if (side == 0) prefetch_weights(blk, F::kBlock);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + F::kD + 16 * side)));
      for (int h = 0; h < 2; ++h) {
        __m256i acci[T];
        if (h == 0) split_half_avx2<F, 0, T>(blk + 32 * side, groups, g, qx, sumh, cols, acci);
        else split_half_avx2<F, 1, T>(blk + 32 * side, groups, g, qx, sumh, cols, acci);
        const __m128i sc =
            _mm_loadl_epi64((const __m128i*)(blk + F::kScales + 16 * h + 8 * side));
        const __m256 ds = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        for (int t = 0; t < T; ++t) {
          const __m256 scale = _mm256_mul_ps(ds, _mm256_set1_ps(dx[t * groups + g]));
          accf[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[t]), scale, accf[t]);
        }
      }
      if constexpr (F::kMin) {
        const __m256 m =
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + F::kM + 16 * side)));
        for (int t = 0; t < T; ++t) {
          const __m256 sumx = _mm256_set1_ps(split_sumx(dx, sumh, t * groups + g));
          accf[t] = _mm256_fmadd_ps(m, sumx, accf[t]);
        }
      }
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(y + t * ldy + 8 * side, accf[t]);
  }
}

// ---- dispatch ----------------------------------------------------------------------------------
// Panel kernels (Int8PanelFn, qgemm.h) for up to kInt8TileAvx512 tokens.

template <int T>
void w4_avx512(const uint8_t* b, int64_t g, const int8_t* q, const float* d, const void* s,
               int64_t c, float* y, int64_t l) {
  w4_panel_avx512<T>(b, g, q, d, static_cast<const float*>(s), c, y, l);
}
template <int T>
void w4_avx2(const uint8_t* b, int64_t g, const int8_t* q, const float* d, const void* s,
             int64_t c, float* y, int64_t l) {
  w4_panel_avx2<T>(b, g, q, d, static_cast<const float*>(s), c, y, l);
}
template <int T>
void w8_avx512(const uint8_t* b, int64_t g, const int8_t* q, const float* d, const void* s,
               int64_t c, float* y, int64_t l) {
  w8_panel_avx512<T>(b, g, q, d, static_cast<const int32_t*>(s), c, y, l);
}
template <int T>
void w8_avx2(const uint8_t* b, int64_t g, const int8_t* q, const float* d, const void* s,
             int64_t c, float* y, int64_t l) {
  w8_panel_avx2<T>(b, g, q, d, static_cast<const int32_t*>(s), c, y, l);
}
template <int T, class F>
void split_avx512(const uint8_t* b, int64_t g, const int8_t* q, const float* d, const void* s,
                  int64_t c, float* y, int64_t l) {
  split_panel_avx512<T, F>(b, g, q, d, static_cast<const int32_t*>(s), c, y, l);
}
template <int T, class F>
void split_avx2(const uint8_t* b, int64_t g, const int8_t* q, const float* d, const void* s,
                int64_t c, float* y, int64_t l) {
  split_panel_avx2<T, F>(b, g, q, d, static_cast<const int32_t*>(s), c, y, l);
}

template <class F>
Int8PanelKernels split_kernels(Isa isa) {
  if (isa == Isa::kAvx512Vnni)
    return {{split_avx512<1, F>, split_avx512<2, F>, split_avx512<3, F>, split_avx512<4, F>,
             split_avx512<5, F>, split_avx512<6, F>, split_avx512<7, F>, split_avx512<8, F>},
            kInt8TileAvx512};
  return {{split_avx2<1, F>, split_avx2<2, F>, split_avx2<3, F>, split_avx2<4, F>}, kInt8TileAvx2W4};
}

Int8PanelKernels kernels_for(int bits, Isa isa) {
  if (is_fp4_format(bits)) return fp4_panel_kernels(bits, isa);
  switch (bits) {
    case kFormatW6A8:
      return split_kernels<W6>(isa);
    case kFormatW6MA8:
      return split_kernels<W6M>(isa);
    case kFormatW5A8:
      return split_kernels<W5>(isa);
    case kFormatW5MA8:
      return split_kernels<W5M>(isa);
    default:
      break;
  }
  if (isa == Isa::kAvx512Vnni) {
    if (bits == kFormatW4A8)
      return {{w4_avx512<1>, w4_avx512<2>, w4_avx512<3>, w4_avx512<4>, w4_avx512<5>, w4_avx512<6>,
               w4_avx512<7>, w4_avx512<8>},
              kInt8TileAvx512};
    return {{w8_avx512<1>, w8_avx512<2>, w8_avx512<3>, w8_avx512<4>, w8_avx512<5>, w8_avx512<6>,
             w8_avx512<7>, w8_avx512<8>},
            kInt8TileAvx512};
  }
  if (bits == kFormatW4A8) return {{w4_avx2<1>, w4_avx2<2>, w4_avx2<3>, w4_avx2<4>}, kInt8TileAvx2W4};
  return {{w8_avx2<1>, w8_avx2<2>}, kInt8TileAvx2};
}

// The per-group sums of qx a format's panels read, from group `first` (row-major over rows and
// groups) on: W4 the float dx * sum, the split formats the two halves' int32 sums, W8 the
// int32 sum.
const void* panel_sums(const ActivationBuffers& buffers, int bits, int64_t first) {
  if (bits == kFormatW4A8) return buffers.sumx.data_ptr<float>() + first;
  if (is_split_format(bits) || bits == kFormatNvfp4A8)
    return buffers.sumh.data_ptr<int32_t>() + 2 * first;
  return buffers.sumq.data_ptr<int32_t>() + first;
}

}  // namespace

void quantized_linear_raw(const float* x, int64_t rows, int64_t cols, const uint8_t* blocks,
                          int64_t n, int bits, Isa isa, float* y, int64_t ldy,
                          ActivationBuffers& buffers) {
  if (rows == 0) return;
  const int64_t groups = cols / kGroup, panels = n / kPanel;
  const int64_t block = block_bytes(bits);
  const Int8PanelKernels kernels = kernels_for(bits, isa);
  buffers.ensure(rows, cols);
  quantize_activations(x, rows, cols, isa, buffers);
  const int8_t* qx = buffers.qx.data_ptr<int8_t>();
  const float* dx = buffers.dx.data_ptr<float>();
  const int64_t tile = kernels.tile;
  const int64_t tiles = (rows + tile - 1) / tile;
  // Work items are (panel, token tile), panel-major: a panel's weights stay in L1 across its
  // token tiles, and the activations (M x K bytes) stay in L2 across panels.
  at::parallel_for(0, panels * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t panel = item / tiles, t0 = (item % tiles) * tile;
      const int64_t count = std::min(tile, rows - t0);
      const int64_t offset = t0 * groups;
      kernels.fns[count - 1](blocks + panel * groups * block, groups, qx + t0 * cols, dx + offset,
                             panel_sums(buffers, bits, offset), cols,
                             y + t0 * ldy + panel * kPanel, ldy);
    }
  });
  if (bits == kFormatNvfp4A8) apply_tensor_scales(blocks, n, cols, rows, y, ldy);
}

at::Tensor quantized_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t out_features,
                            int bits, const std::string& isa_name) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed: uint8");
  TORCH_CHECK(is_quantized_format(bits), "bits must be 4, 5, 51, 6, 7, 8, 41 or 42");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(cols % kGroup == 0, "in_features must be a multiple of 32, got ", cols);
  TORCH_CHECK(out_features % kPanel == 0, "out_features must be a multiple of 16");
  TORCH_CHECK(packed.numel() == packed_bytes(bits, out_features, cols),
              "packed weight has the wrong size");
  const Isa isa = parse_isa(isa_name);
  at::Tensor y = at::empty({rows, out_features}, x.options());
  thread_local ActivationBuffers buffers;
  quantized_linear_raw(x.data_ptr<float>(), rows, cols, packed.data_ptr<uint8_t>(), out_features,
                       bits, isa, y.data_ptr<float>(), out_features, buffers);
  return y;
}

// ---- packing -----------------------------------------------------------------------------------
// codes: [N, K] uint8 (W4: 0..15; W8: int8 stored as uint8 two's complement), d/m: [N, K/32] f32.
at::Tensor pack_w4(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2, "codes: [N, K] uint8");
  const int64_t rows = codes.size(0), cols = codes.size(1);
  TORCH_CHECK(rows % kPanel == 0 && cols % kGroup == 0, "N % 16 and K % 32 must be 0");
  const int64_t groups = cols / kGroup, panels = rows / kPanel;
  const at::Tensor c = codes.contiguous();
  const at::Tensor dh = d.to(at::kHalf).contiguous(), mh = m.to(at::kHalf).contiguous();
  at::Tensor out = at::empty({panels * groups * kW4Block}, codes.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  const uint16_t* dsrc = reinterpret_cast<const uint16_t*>(dh.data_ptr<at::Half>());
  const uint16_t* msrc = reinterpret_cast<const uint16_t*>(mh.data_ptr<at::Half>());
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* blk = dst + (p * groups + g) * kW4Block;
      uint16_t* dblk = reinterpret_cast<uint16_t*>(blk + kW4Codes);
      for (int r = 0; r < kPanel; ++r) {
        const int64_t row = p * kPanel + r;
        const uint8_t* q = src + row * cols + g * kGroup;
        for (int o = 0; o < 4; ++o) {
          for (int j = 0; j < 4; ++j) {
            blk[64 * o + 4 * r + j] =
                static_cast<uint8_t>((q[8 * o + j] & 0x0F) | ((q[8 * o + 4 + j] & 0x0F) << 4));
          }
        }
        dblk[r] = dsrc[row * groups + g];
        dblk[kPanel + r] = msrc[row * groups + g];
      }
    }
  }
  return out;
}

at::Tensor pack_w8(const at::Tensor& codes, const at::Tensor& d, const std::string& isa_name) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2, "codes: [N, K] int8");
  const int64_t rows = codes.size(0), cols = codes.size(1);
  TORCH_CHECK(rows % kPanel == 0 && cols % kGroup == 0, "N % 16 and K % 32 must be 0");
  const bool offset = parse_isa(isa_name) == Isa::kAvx512Vnni;  // VNNI wants unsigned weights
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
      uint16_t* dblk = reinterpret_cast<uint16_t*>(blk + kW8Codes);
      for (int r = 0; r < kPanel; ++r) {
        const int64_t row = p * kPanel + r;
        const int8_t* q = src + row * cols + g * kGroup;
        for (int cq = 0; cq < 8; ++cq) {
          for (int j = 0; j < 4; ++j) {
            const int value = q[4 * cq + j] + (offset ? 128 : 0);
            blk[64 * cq + 4 * r + j] = static_cast<uint8_t>(value);
          }
        }
        dblk[r] = dsrc[row * groups + g];
      }
    }
  }
  return out;
}

namespace {

// One row r's 32 codes u into a split-format block: the low nibbles as W4's, the high bits
// field by field into the high plane (qgemm.cpp's header).
template <class F>
void pack_split_row(const uint8_t* u, int r, uint8_t* blk) {
  for (int o = 0; o < 4; ++o)
    for (int j = 0; j < 4; ++j)
      blk[64 * o + 4 * r + j] =
          static_cast<uint8_t>((u[8 * o + j] & 15) | ((u[8 * o + 4 + j] & 15) << 4));
  for (int f = 0; f < 8; ++f) {
    const int vector = f / F::kFieldsPerByte, bit = F::kHighBits * (f % F::kFieldsPerByte);
    for (int j = 0; j < 4; ++j)
      blk[F::kHigh + 64 * vector + 4 * r + j] |= static_cast<uint8_t>((u[4 * f + j] >> 4) << bit);
  }
}

// Blocks of split format F. codes: [N, K] int8 in -kOffset .. kCodes - 1 - kOffset (stored as
// u = code + kOffset), d and m: [N, K/32] f32 (stored as fp16; m only with F::kMin), sc:
// [N, K/16] int8. Panels are independent, so they pack in parallel (a model's load packs
// every layer).
template <class F>
at::Tensor pack_split_blocks(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& sc,
                             const at::Tensor& m, const char* name) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2, "codes: [N, K] int8");
  const int64_t rows = codes.size(0), cols = codes.size(1);
  TORCH_CHECK(rows % kPanel == 0 && cols % kGroup == 0, "N % 16 and K % 32 must be 0");
  const int64_t groups = cols / kGroup, panels = rows / kPanel;
  TORCH_CHECK(d.numel() == rows * groups, "d: [N, K/32]");
  TORCH_CHECK(sc.scalar_type() == at::kChar && sc.numel() == rows * 2 * groups,
              "sc: [N, K/16] int8");
  TORCH_CHECK(m.defined() == F::kMin, F::kMin ? "m: [N, K/32]" : "this format has no m");
  TORCH_CHECK(!F::kMin || m.numel() == rows * groups, "m: [N, K/32]");
  if (codes.numel() > 0) {
    const auto [low, high] = at::aminmax(codes);
    TORCH_CHECK(low.item<int8_t>() >= -F::kOffset && high.item<int8_t>() < F::kCodes - F::kOffset,
                name, " codes must lie in ", -F::kOffset, "..", F::kCodes - 1 - F::kOffset);
  }
  const at::Tensor c = codes.contiguous(), s = sc.contiguous();
  const at::Tensor dh = d.to(at::kHalf).contiguous();
  const at::Tensor mh = F::kMin ? m.to(at::kHalf).contiguous() : at::Tensor();
  at::Tensor out = at::zeros({panels * groups * F::kBlock}, codes.options().dtype(at::kByte));
  const int8_t* src = c.data_ptr<int8_t>();
  const int8_t* scales = s.data_ptr<int8_t>();
  const uint16_t* dsrc = reinterpret_cast<const uint16_t*>(dh.data_ptr<at::Half>());
  const uint16_t* msrc =
      F::kMin ? reinterpret_cast<const uint16_t*>(mh.data_ptr<at::Half>()) : nullptr;
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t p = idx / groups, g = idx % groups;
      uint8_t* blk = dst + idx * F::kBlock;
      for (int r = 0; r < kPanel; ++r) {
        const int64_t row = p * kPanel + r;
        const int8_t* q = src + row * cols + g * kGroup;
        uint8_t u[kGroup];
        for (int k = 0; k < kGroup; ++k) u[k] = static_cast<uint8_t>(q[k] + F::kOffset);
        pack_split_row<F>(u, r, blk);
        for (int h = 0; h < 2; ++h)
          blk[F::kScales + 16 * h + r] = static_cast<uint8_t>(scales[row * 2 * groups + 2 * g + h]);
        std::memcpy(blk + F::kD + 2 * r, dsrc + row * groups + g, 2);
        if constexpr (F::kMin) std::memcpy(blk + F::kM + 2 * r, msrc + row * groups + g, 2);
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor pack_w6(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& sc) {
  return pack_split_blocks<W6>(codes, d, sc, at::Tensor(), "W6");
}

at::Tensor pack_w6m(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& sc,
                    const at::Tensor& m) {
  return pack_split_blocks<W6M>(codes, d, sc, m, "W6M");
}

at::Tensor pack_w5(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& sc) {
  return pack_split_blocks<W5>(codes, d, sc, at::Tensor(), "W5");
}

at::Tensor pack_w5m(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& sc,
                    const at::Tensor& m) {
  return pack_split_blocks<W5M>(codes, d, sc, m, "W5M");
}

}  // namespace densa
