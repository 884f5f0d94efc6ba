// Vector building blocks of the fused decoder, once per code path (AVX-512, AVX2).
//
// Each path is a struct of static functions compiled for its own instruction set (a GCC target
// attribute per function), so one binary carries both and the caller picks one at run time.
// Every function handles any length (a masked or scalar tail), so shapes need no padding.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace densa {

#define DENSA_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define DENSA_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

// exp(x) for float32 lanes: Cephes' polynomial on x = n ln2 + r, as numba_intrinsics.exp_neg;
// inputs below -87 give ~0 (never a subnormal, never NaN for finite input).
struct Avx512 {
  static constexpr int kWidth = 16;
  static constexpr int kDenseRows = 4;  // weight rows per dense_rows step: 4 x 4 accumulators

  DENSA_AVX512_TARGET static inline __m512 exp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.4426950408889634f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 rr = _mm512_mul_ps(r, r);
    p = _mm512_add_ps(_mm512_fmadd_ps(p, rr, r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);  // p * 2**n
  }

  DENSA_AVX512_TARGET static inline __mmask16 tail(int64_t left) {
    return left >= 16 ? static_cast<__mmask16>(0xFFFF)
                      : static_cast<__mmask16>((1u << left) - 1u);
  }

  // e4m3 codes (one per 32-bit lane) -> float32, exactly (what the 256-entry table holds, for
  // every code a store writes: NaN is never stored), in registers instead of a 16-load gather.
  // A normal code s.eeee.mmm is 2**(e-7) (1 + m/8): its magnitude bits moved to float32's
  // exponent and mantissa fields read as 2**(e-127) (1 + m/8), times 2**120. A subnormal (e = 0)
  // is m * 2**-9, converted from the integer (no float32 subnormal, so flush-to-zero modes
  // cannot change it).
  DENSA_AVX512_TARGET static inline __m512 e4m3_to_float(__m512i codes) {
    const __m512i magnitude = _mm512_and_si512(codes, _mm512_set1_epi32(0x7F));
    const __m512 normal = _mm512_mul_ps(
        _mm512_castsi512_ps(_mm512_slli_epi32(magnitude, 20)), _mm512_set1_ps(0x1p120f));
    const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(0x1p-9f));
    const __mmask16 is_sub = _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(0x08));
    const __m512 value = _mm512_mask_blend_ps(is_sub, normal, subnormal);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(codes, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
  }

  // y = x * w / rms(x): RMSNorm of one row.
  DENSA_AVX512_TARGET static void rmsnorm(const float* x, const float* w, float* y, int64_t n,
                                          float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(tail(n - i), x + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps);
    const __m512 s = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail(n - i);
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), s);
      _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
    }
  }

  // out[i] = silu(gate[i]) * up[i]
  DENSA_AVX512_TARGET static void silu_mul(const float* gate, const float* up, float* out,
                                           int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail(n - i);
      const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
      const __m512 sig = _mm512_div_ps(
          _mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), exp(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      _mm512_mask_storeu_ps(out + i, m,
                            _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_maskz_loadu_ps(m, up + i)));
    }
  }

  // y[t, r] = w[r] . x[t] for rows r of a dense [*, k] weight, tokens t < T, R weight rows at a
  // time. Every y[t, r] is the same arithmetic whatever T and R: one vector accumulator over k in
  // order, then one horizontal sum, so a token's result never depends on the batch it is in.
  template <int T, int R = 1>
  DENSA_AVX512_TARGET static void dense_rows(const float* w, int64_t k, int64_t r0, int64_t r1,
                                             const float* x, float* y, int64_t ldy) {
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
      __m512 acc[R][T];
      for (int j = 0; j < R; ++j)
        for (int t = 0; t < T; ++t) acc[j][t] = _mm512_setzero_ps();
      for (int64_t i = 0; i < k; i += 16) {
        const __mmask16 m = tail(k - i);
        __m512 wv[R];
        for (int j = 0; j < R; ++j) wv[j] = _mm512_maskz_loadu_ps(m, w + (r + j) * k + i);
        for (int t = 0; t < T; ++t) {
          const __m512 xv = _mm512_maskz_loadu_ps(m, x + t * k + i);
          for (int j = 0; j < R; ++j) acc[j][t] = _mm512_fmadd_ps(wv[j], xv, acc[j][t]);
        }
      }
      for (int j = 0; j < R; ++j)
        for (int t = 0; t < T; ++t) y[t * ldy + r + j] = _mm512_reduce_add_ps(acc[j][t]);
    }
    if (R > 1 && r < r1) dense_rows<T, 1>(w, k, r, r1, x, y, ldy);
  }

  // Scores of G query rows q [G, D] against `count` key rows k [count, D]: s[g * ld + j].
  // Keys go 16 at a time: one accumulator per key over D, then the 16 sums in one tree of
  // shuffles (reduce16) instead of a horizontal sum per (key, head).
  DENSA_AVX512_TARGET static void scores(const float* q, int g_count, int d, const float* k,
                                         int count, float* s, int ld) {
    int j = 0;
    for (; j + 16 <= count; j += 16) {
      for (int g = 0; g < g_count; ++g) {
        __m512 acc[16];
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
        for (int i = 0; i < d; i += 16) {
          const __mmask16 m = tail(d - i);
          const __m512 qv = _mm512_maskz_loadu_ps(m, q + g * d + i);
          for (int r = 0; r < 16; ++r)
            acc[r] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, k + (j + r) * d + i), acc[r]);
        }
        _mm512_storeu_ps(s + g * ld + j, reduce16(acc));
      }
    }
    for (; j < count; ++j) {
      const float* kr = k + j * d;
      for (int g = 0; g < g_count; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < d; i += 16) {
          const __mmask16 m = tail(d - i);
          acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + g * d + i),
                                _mm512_maskz_loadu_ps(m, kr + i), acc);
        }
        s[g * ld + j] = _mm512_reduce_add_ps(acc);
      }
    }
  }

  // Lane r of the result = the sum of a[r]'s 16 lanes.
  DENSA_AVX512_TARGET static inline __m512 reduce16(const __m512* a) {
    __m512 t[8], u[4];
    for (int r = 0; r < 8; ++r)  // per 128-bit lane: [a0+a2 | a1+a2'...] pairs interleaved
      t[r] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * r], a[2 * r + 1]),
                           _mm512_unpackhi_ps(a[2 * r], a[2 * r + 1]));
    for (int r = 0; r < 4; ++r)  // per 128-bit lane: the partial sums of 4 keys, in order
      u[r] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * r], t[2 * r + 1], 0x44),
                           _mm512_shuffle_ps(t[2 * r], t[2 * r + 1], 0xEE));
    // Add the four 128-bit lanes of each u, keys 4r..4r+3 landing in lane block r.
    const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                     _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                     _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88),
                         _mm512_shuffle_f32x4(z01, z23, 0xDD));
  }

  // p[i] = exp(s[i] - max), returns the sum; n <= any.
  DENSA_AVX512_TARGET static float exp_shifted(float* s, int n, float max) {
    __m512 total = _mm512_setzero_ps();
    const __m512 mx = _mm512_set1_ps(max);
    for (int i = 0; i < n; i += 16) {
      const __mmask16 m = tail(n - i);
      const __m512 p = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), mx));
      _mm512_mask_storeu_ps(s + i, m, p);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, p));
    }
    return _mm512_reduce_add_ps(total);
  }

  // For every head g < G: acc[g][D] = acc[g] * alpha[g] + sum_j p[g * ld + j] v[j], the sum in
  // j order. Heads go up to 16 at a time, so each value row is loaded once per 16 heads.
  DENSA_AVX512_TARGET static void weighted_sum(float* acc, const float* alpha, const float* p,
                                               int ld, const float* v, int count, int d,
                                               int g_count) {
    for (int g0 = 0; g0 < g_count; g0 += 16) {
      const int gn = std::min(16, g_count - g0);
      for (int i = 0; i < d; i += 16) {
        const __mmask16 m = tail(d - i);
        __m512 a[16];
        for (int g = 0; g < gn; ++g)
          a[g] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc + (g0 + g) * d + i),
                               _mm512_set1_ps(alpha[g0 + g]));
        for (int j = 0; j < count; ++j) {
          const __m512 vv = _mm512_maskz_loadu_ps(m, v + j * d + i);
          for (int g = 0; g < gn; ++g)
            a[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[(g0 + g) * ld + j]), vv, a[g]);
        }
        for (int g = 0; g < gn; ++g) _mm512_mask_storeu_ps(acc + (g0 + g) * d + i, m, a[g]);
      }
    }
  }

  // n fp16 values (bits) -> float32 (F16C: every code exactly, as half_to_float).
  DENSA_AVX512_TARGET static void halves_to_float(const uint16_t* h, int n, float* out) {
    for (int i = 0; i < n; i += 16) {
      const __mmask16 m = tail(n - i);
      const __m256i bits = _mm256_maskz_loadu_epi16(m, h + i);
      _mm512_mask_storeu_ps(out + i, m, _mm512_cvtph_ps(bits));
    }
  }

  // Widen n cache elements to float32 and multiply by scale: f32 / bf16 bits / e4m3 codes /
  // int8 codes (dtype 0 / 1 / 2 / 3).
  DENSA_AVX512_TARGET static void widen(const void* src, int dtype, int n, float scale,
                                        const float* fp8_table, float* out) {
    const __m512 sv = _mm512_set1_ps(scale);
    for (int i = 0; i < n; i += 16) {
      const __mmask16 m = tail(n - i);
      __m512 v;
      if (dtype == 0) {
        v = _mm512_maskz_loadu_ps(m, static_cast<const float*>(src) + i);
      } else if (dtype == 1) {
        const __m256i bits = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(src) + i);
        v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
      } else if (dtype == 3) {
        const __m128i codes = _mm_maskz_loadu_epi8(m, static_cast<const int8_t*>(src) + i);
        v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
      } else {
        const __m128i codes = _mm_maskz_loadu_epi8(m, static_cast<const uint8_t*>(src) + i);
        v = e4m3_to_float(_mm512_cvtepu8_epi32(codes));
      }
      _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(v, sv));
    }
  }
};

struct Avx2 {
  static constexpr int kWidth = 8;
  static constexpr int kDenseRows = 2;  // 2 x 4 accumulators: AVX2 has 16 vector registers

  DENSA_AVX2_TARGET static inline __m256 exp(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.f));
    const __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.4426950408889634f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 rr = _mm256_mul_ps(r, r);
    p = _mm256_add_ps(_mm256_fmadd_ps(p, rr, r), _mm256_set1_ps(1.f));
    // 2**n from the exponent bits (n in [-126, 127] after the clamps above).
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }

  DENSA_AVX2_TARGET static inline __m256i tail(int64_t left) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int count = left >= 8 ? 8 : static_cast<int>(left);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), idx);
  }

  DENSA_AVX2_TARGET static inline float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  }

  // As Avx512::e4m3_to_float, 8 lanes.
  DENSA_AVX2_TARGET static inline __m256 e4m3_to_float(__m256i codes) {
    const __m256i magnitude = _mm256_and_si256(codes, _mm256_set1_epi32(0x7F));
    const __m256 normal = _mm256_mul_ps(
        _mm256_castsi256_ps(_mm256_slli_epi32(magnitude, 20)), _mm256_set1_ps(0x1p120f));
    const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(0x1p-9f));
    const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x08), magnitude));
    const __m256 value = _mm256_blendv_ps(normal, subnormal, is_sub);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(0x80)), 24);
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(value), sign));
  }

  DENSA_AVX2_TARGET static void rmsnorm(const float* x, const float* w, float* y, int64_t n,
                                        float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 v = _mm256_maskload_ps(x + i, tail(n - i));
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    const float inv = 1.f / std::sqrt(hsum(acc) / static_cast<float>(n) + eps);
    const __m256 s = _mm256_set1_ps(inv);
    for (int64_t i = 0; i < n; i += 8) {
      const __m256i m = tail(n - i);
      const __m256 v = _mm256_mul_ps(_mm256_maskload_ps(x + i, m), s);
      _mm256_maskstore_ps(y + i, m, _mm256_mul_ps(v, _mm256_maskload_ps(w + i, m)));
    }
  }

  DENSA_AVX2_TARGET static void silu_mul(const float* gate, const float* up, float* out,
                                         int64_t n) {
    for (int64_t i = 0; i < n; i += 8) {
      const __m256i m = tail(n - i);
      const __m256 g = _mm256_maskload_ps(gate + i, m);
      const __m256 sig = _mm256_div_ps(
          _mm256_set1_ps(1.f), _mm256_add_ps(_mm256_set1_ps(1.f), exp(_mm256_sub_ps(_mm256_setzero_ps(), g))));
      _mm256_maskstore_ps(out + i, m,
                          _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_maskload_ps(up + i, m)));
    }
  }

  template <int T, int R = 1>
  DENSA_AVX2_TARGET static void dense_rows(const float* w, int64_t k, int64_t r0, int64_t r1,
                                           const float* x, float* y, int64_t ldy) {
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
      __m256 acc[R][T];
      for (int j = 0; j < R; ++j)
        for (int t = 0; t < T; ++t) acc[j][t] = _mm256_setzero_ps();
      for (int64_t i = 0; i < k; i += 8) {
        const __m256i m = tail(k - i);
        __m256 wv[R];
        for (int j = 0; j < R; ++j) wv[j] = _mm256_maskload_ps(w + (r + j) * k + i, m);
        for (int t = 0; t < T; ++t) {
          const __m256 xv = _mm256_maskload_ps(x + t * k + i, m);
          for (int j = 0; j < R; ++j) acc[j][t] = _mm256_fmadd_ps(wv[j], xv, acc[j][t]);
        }
      }
      for (int j = 0; j < R; ++j)
        for (int t = 0; t < T; ++t) y[t * ldy + r + j] = hsum(acc[j][t]);
    }
    if (R > 1 && r < r1) dense_rows<T, 1>(w, k, r, r1, x, y, ldy);
  }

  DENSA_AVX2_TARGET static void scores(const float* q, int g_count, int d, const float* k,
                                       int count, float* s, int ld) {
    int j = 0;
    for (; j + 8 <= count; j += 8) {  // 8 keys at a time, their sums in one tree (reduce8)
      for (int g = 0; g < g_count; ++g) {
        __m256 acc[8];
        for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
          const __m256i m = tail(d - i);
          const __m256 qv = _mm256_maskload_ps(q + g * d + i, m);
          for (int r = 0; r < 8; ++r)
            acc[r] = _mm256_fmadd_ps(qv, _mm256_maskload_ps(k + (j + r) * d + i, m), acc[r]);
        }
        _mm256_storeu_ps(s + g * ld + j, reduce8(acc));
      }
    }
    for (; j < count; ++j) {
      const float* kr = k + j * d;
      for (int g = 0; g < g_count; ++g) {
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
          const __m256i m = tail(d - i);
          acc = _mm256_fmadd_ps(_mm256_maskload_ps(q + g * d + i, m),
                                _mm256_maskload_ps(kr + i, m), acc);
        }
        s[g * ld + j] = hsum(acc);
      }
    }
  }

  // Lane r of the result = the sum of a[r]'s 8 lanes.
  DENSA_AVX2_TARGET static inline __m256 reduce8(const __m256* a) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                         _mm256_permute2f128_ps(t0, t1, 0x31));
  }

  DENSA_AVX2_TARGET static float exp_shifted(float* s, int n, float max) {
    __m256 total = _mm256_setzero_ps();
    const __m256 mx = _mm256_set1_ps(max);
    for (int i = 0; i < n; i += 8) {
      const __m256i m = tail(n - i);
      const __m256 p = _mm256_and_ps(exp(_mm256_sub_ps(_mm256_maskload_ps(s + i, m), mx)),
                                     _mm256_castsi256_ps(m));
      _mm256_maskstore_ps(s + i, m, p);
      total = _mm256_add_ps(total, p);
    }
    return hsum(total);
  }

  DENSA_AVX2_TARGET static void weighted_sum(float* acc, const float* alpha, const float* p,
                                             int ld, const float* v, int count, int d,
                                             int g_count) {
    for (int g0 = 0; g0 < g_count; g0 += 8) {  // 8 heads' accumulators of 16 registers
      const int gn = std::min(8, g_count - g0);
      for (int i = 0; i < d; i += 8) {
        const __m256i m = tail(d - i);
        __m256 a[8];
        for (int g = 0; g < gn; ++g)
          a[g] = _mm256_mul_ps(_mm256_maskload_ps(acc + (g0 + g) * d + i, m),
                               _mm256_set1_ps(alpha[g0 + g]));
        for (int j = 0; j < count; ++j) {
          const __m256 vv = _mm256_maskload_ps(v + j * d + i, m);
          for (int g = 0; g < gn; ++g)
            a[g] = _mm256_fmadd_ps(_mm256_set1_ps(p[(g0 + g) * ld + j]), vv, a[g]);
        }
        for (int g = 0; g < gn; ++g) _mm256_maskstore_ps(acc + (g0 + g) * d + i, m, a[g]);
      }
    }
  }

  DENSA_AVX2_TARGET static void halves_to_float(const uint16_t* h, int n, float* out) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i,
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
    for (; i < n; ++i) out[i] = _cvtsh_ss(h[i]);
  }

  DENSA_AVX2_TARGET static void widen(const void* src, int dtype, int n, float scale,
                                      const float* fp8_table, float* out) {
    // Full groups of 8 widen in vectors (8-byte / 16-byte loads, e4m3 in registers);
    // a tail below 8 (head_dim is a multiple of 8 in every supported model) goes scalar, since
    // AVX2 has no masked byte or word loads.
    const __m256 sv = _mm256_set1_ps(scale);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 v;
      if (dtype == 0) {
        v = _mm256_loadu_ps(static_cast<const float*>(src) + i);
      } else if (dtype == 1) {
        const __m128i bits = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + i));
        v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
      } else {
        const __m128i codes = _mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(src) + i));
        if (dtype == 3) {
          v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
        } else {
          v = e4m3_to_float(_mm256_cvtepu8_epi32(codes));
        }
      }
      _mm256_storeu_ps(out + i, _mm256_mul_ps(v, sv));
    }
    for (; i < n; ++i) {
      float value;
      if (dtype == 0) {
        value = static_cast<const float*>(src)[i];
      } else if (dtype == 1) {
        const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(src)[i]) << 16;
        std::memcpy(&value, &bits, 4);
      } else if (dtype == 3) {
        value = static_cast<float>(static_cast<const int8_t*>(src)[i]);
      } else {
        value = fp8_table[static_cast<const uint8_t*>(src)[i]];
      }
      out[i] = value * scale;
    }
  }
};

}  // namespace densa
