// The delta rule's decode step (Gated DeltaNet, Kimi's KDA) over a pool of state slots, in place.
// Why a kernel: torch's batched form gathers every request's state (H x Dk x Dv floats, 2 MB at
// Qwen3-Next's 32 x 128 x 128) into a copy, makes three more state-sized temporaries (decayed,
// outer product, sum) and scatters it back: ~6 state-sized passes through memory per layer where
// the recurrence needs one read and one write. Here each (request, head) walks its own slot's
// state in column blocks held in L1 (delta_rule_body.inc), one thread per (request, head).
#include "delta_rule.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "qgemm.h"

namespace densa {
namespace {

// One token of one head: its vectors, exp(log_decay) per key row, and where its output goes.
struct HeadToken {
  const float *q, *k, *v, *decay;
  float beta;
  float* out;
};

// A head's T tokens: token t's q / k / v / out rows lie `stride_*` floats after token t - 1's.
struct HeadTokens {
  int64_t num_tokens;
  const float *q, *k, *v, *beta, *decay;  // decay: [T][Dk], this head's exp(log_decay)
  float* out;
  int64_t stride_qk, stride_v, stride_beta, dk;

  HeadToken token(int64_t t) const {
    return {q + t * stride_qk, k + t * stride_qk, v + t * stride_v, decay + t * dk,
            beta[t * stride_beta], out + t * stride_v};
  }
};

// Column c of a head's state, one token: token_block's arithmetic in scalars (the tail).
inline void token_column(const HeadToken& tok, float* s, int64_t dk, int64_t dv, int64_t c) {
  float kv = 0.f, out = 0.f;
  for (int64_t i = 0; i < dk; ++i) kv = std::fma(tok.k[i], s[i * dv + c] * tok.decay[i], kv);
  const float delta = tok.beta * (tok.v[c] - kv);
  for (int64_t i = 0; i < dk; ++i) {
    const float updated = std::fma(tok.k[i], delta, s[i * dv + c] * tok.decay[i]);
    s[i * dv + c] = updated;
    out = std::fma(tok.q[i], updated, out);
  }
  tok.out[c] = out;
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,fma")
namespace delta_avx512 {
using Vec = __m512;
constexpr int kLanes = 16, kBlockVecs = 2;  // 32 columns: a 16 KB block at Dk = 128
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec x) { _mm512_storeu_ps(p, x); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#include "delta_rule_body.inc"
}  // namespace delta_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace delta_avx2 {
using Vec = __m256;
constexpr int kLanes = 8, kBlockVecs = 4;  // the same 32 columns
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec x) { _mm256_storeu_ps(p, x); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#include "delta_rule_body.inc"
}  // namespace delta_avx2
#pragma GCC pop_options

namespace {

void check_input(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu() &&
                  t.dim() == dim,
              what, ": contiguous float32 CPU tensor of ", dim, " dims");
}

// The slots must exist and be distinct: two threads updating one slot would race.
void check_slots(const at::Tensor& slot_ids, int64_t batch, int64_t num_slots) {
  TORCH_CHECK(slot_ids.scalar_type() == at::kLong && slot_ids.is_contiguous() &&
                  slot_ids.numel() == batch,
              "slot_ids: contiguous int64 [B]");
  std::vector<char> seen(num_slots, 0);
  const int64_t* ids = slot_ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(ids[b] >= 0 && ids[b] < num_slots, "slot id ", ids[b], " out of range");
    TORCH_CHECK(!seen[ids[b]], "slot id ", ids[b], " appears twice");
    seen[ids[b]] = 1;
  }
}

// exp(log_decay) of head (b, h) for each token, one value per key row: [T][Dk].
void fill_decay(const at::Tensor& log_decay, int64_t b, int64_t h, int64_t num_heads,
                int64_t num_tokens, int64_t dk, std::vector<float>& decay) {
  const bool per_channel = log_decay.dim() == 4;
  const float* base = log_decay.data_ptr<float>();
  decay.resize(num_tokens * dk);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t row = (b * num_tokens + t) * num_heads + h;
    for (int64_t i = 0; i < dk; ++i)
      decay[t * dk + i] = std::exp(per_channel ? base[row * dk + i] : base[row]);
  }
}

}  // namespace

at::Tensor delta_rule_steps(const at::Tensor& state_pool, const at::Tensor& slot_ids,
                            const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& log_decay, const at::Tensor& beta,
                            const std::string& isa) {
  check_input(q, 4, "q"), check_input(k, 4, "k"), check_input(v, 4, "v");
  check_input(beta, 3, "beta");
  const int64_t batch = q.size(0), num_tokens = q.size(1), num_heads = q.size(2);
  const int64_t dk = q.size(3), dv = v.size(3);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == batch && v.size(1) == num_tokens &&
                  v.size(2) == num_heads && beta.sizes() == q.sizes().slice(0, 3),
              "q, k [B, T, H, Dk], v [B, T, H, Dv], beta [B, T, H]");
  TORCH_CHECK(log_decay.scalar_type() == at::kFloat && log_decay.is_contiguous() &&
                  (log_decay.sizes() == beta.sizes() || log_decay.sizes() == q.sizes()),
              "log_decay: contiguous float32 [B, T, H] or [B, T, H, Dk]");
  TORCH_CHECK(state_pool.scalar_type() == at::kFloat && state_pool.device().is_cpu() &&
                  state_pool.dim() == 4 && state_pool.size(1) == num_heads &&
                  state_pool.size(2) == dk && state_pool.size(3) == dv &&
                  state_pool.stride(3) == 1 && state_pool.stride(2) == dv &&
                  state_pool.stride(1) == dk * dv,
              "state_pool: float32 [num_slots, H, Dk, Dv], each slot contiguous");
  check_slots(slot_ids, batch, state_pool.size(0));
  const Isa path = parse_isa(isa);
  at::Tensor out = at::empty({batch, num_tokens, num_heads, dv}, q.options());
  const int64_t* ids = slot_ids.data_ptr<int64_t>();
  float* pool = state_pool.data_ptr<float>();
  at::parallel_for(0, batch * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> decay;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_heads, h = item % num_heads;
      fill_decay(log_decay, b, h, num_heads, num_tokens, dk, decay);
      const int64_t first = b * num_tokens * num_heads + h;  // row (b, 0, h) of [B, T, H]
      const HeadTokens head{num_tokens, q.data_ptr<float>() + first * dk,
                            k.data_ptr<float>() + first * dk, v.data_ptr<float>() + first * dv,
                            beta.data_ptr<float>() + first, decay.data(),
                            out.data_ptr<float>() + first * dv, num_heads * dk, num_heads * dv,
                            num_heads, dk};
      float* s = pool + ids[b] * state_pool.stride(0) + h * dk * dv;
      if (path == Isa::kAvx512Vnni) {
        delta_avx512::head_steps(head, s, dk, dv);
      } else {
        delta_avx2::head_steps(head, s, dk, dv);
      }
    }
  });
  return out;
}

}  // namespace densa
