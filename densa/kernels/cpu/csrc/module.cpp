// Python bindings of densa's C++ CPU kernels (qgemm.cpp: W4A8 / W5A8 / W5MA8 / W6A8 / W6MA8 /
// W8A8 matmuls; decoder.cpp: the fused decode step). The only file that includes
// torch/extension.h (pybind11), so the kernels themselves compile against ATen alone.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "decoder.h"
#include "delta_rule.h"
#include "prefill_attention.h"
#include "qgemm.h"
#include "vec.h"

namespace densa {
namespace {

// A projection as Python passes it: (bits, tensor, bias or None, out_features, in_features),
// bits 32 = dense float32 [out, in], 4 / 5 / 51 / 6 / 7 / 8 / 80 = packed w4a8 / w5a8 / w5ma8 /
// w6a8 / w6ma8 / w8a8 / w8 blocks (qgemm.h); or a sharded one, ([(bits, tensor, out_features),
// ...], bias or None, out_features, in_features), whose shards' outputs lie side by side.
using ProjectionSpec = std::tuple<int64_t, at::Tensor, std::optional<at::Tensor>, int64_t, int64_t>;
using ShardSpec = std::tuple<int64_t, at::Tensor, int64_t>;
using ShardedSpec =
    std::tuple<std::vector<ShardSpec>, std::optional<at::Tensor>, int64_t, int64_t>;
using AnyProjectionSpec = std::variant<ProjectionSpec, ShardedSpec>;

Shard make_shard(int64_t bits, const at::Tensor& tensor, int64_t out, int64_t in) {
  Shard s;
  s.bits = static_cast<int>(bits);
  s.out = out;
  TORCH_CHECK(tensor.is_contiguous() && tensor.device().is_cpu(), "weights: contiguous CPU");
  if (s.bits == kFormatDense) {
    TORCH_CHECK(tensor.scalar_type() == at::kFloat && tensor.dim() == 2 &&
                    tensor.size(0) == out && tensor.size(1) == in,
                "dense weight: float32 [out, in]");
    s.dense = tensor;
    return s;
  }
  TORCH_CHECK(block_bytes(s.bits) > 0,
              "bits: 4 (w4a8), 5 (w5a8), 51 (w5ma8), 6 (w6a8), 7 (w6ma8), 8 (w8a8), 80 (w8), "
              "41 (mxfp4a8), 42 (nvfp4a8), 43 (mxfp4), 44 (nvfp4) or 32 (dense)");
  TORCH_CHECK(tensor.scalar_type() == at::kByte, "packed weight: uint8 blocks");
  TORCH_CHECK(in % kGroup == 0 && out % kPanel == 0, "packed shape does not tile");
  TORCH_CHECK(tensor.numel() == packed_bytes(s.bits, out, in), "packed size");
  s.packed = tensor;
  s.blocks = tensor.data_ptr<uint8_t>();
  return s;
}

Projection make_projection(const AnyProjectionSpec& spec) {
  Projection p;
  std::optional<at::Tensor> bias;
  if (const auto* one = std::get_if<ProjectionSpec>(&spec)) {
    const auto& [bits, tensor, b, out, in] = *one;
    p.out = out, p.in = in, bias = b;
    p.shards.push_back(make_shard(bits, tensor, out, in));
  } else {
    const auto& [shards, b, out, in] = std::get<ShardedSpec>(spec);
    p.out = out, p.in = in, bias = b;
    int64_t total = 0;
    for (const auto& [bits, tensor, rows] : shards) {
      p.shards.push_back(make_shard(bits, tensor, rows, in));
      total += rows;
    }
    TORCH_CHECK(!shards.empty() && total == out, "shards' out_features must add up to out");
  }
  if (bias.has_value()) {
    p.bias_tensor = bias->contiguous().to(at::kFloat);
    TORCH_CHECK(p.bias_tensor.numel() == p.out, "bias: [out]");
    p.bias = p.bias_tensor.data_ptr<float>();
  }
  return p;
}

KVSide make_kv_side(const at::Tensor& cache, const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && cache.device().is_cpu(),
              "KV cache: contiguous CPU [pages, kv_heads, page_size, head_dim]");
  KVSide side;
  side.tensor = cache;
  side.data = cache.data_ptr();
  side.num_kv_heads = cache.size(1);
  side.page_size = cache.size(2);
  const auto dtype = cache.scalar_type();
  if (dtype == at::kFloat) {
    side.dtype = kKvF32;
  } else if (dtype == at::kBFloat16) {
    side.dtype = kKvBf16;
  } else if (dtype == at::kFloat8_e4m3fn) {
    side.dtype = kKvFp8;
  } else if (dtype == at::kChar) {
    side.dtype = kKvInt8;
  } else {
    TORCH_CHECK(false, "KV cache dtype must be float32, bfloat16, float8_e4m3fn or int8");
  }
  if (side.dtype == kKvInt8) {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kHalf && scale->is_contiguous() &&
                    scale->numel() == cache.size(0) * cache.size(1) * cache.size(2),
                "int8 caches need contiguous fp16 row scales [pages, kv_heads, page_size]");
    side.row_scale_tensor = *scale;
    side.row_scales = reinterpret_cast<uint16_t*>(scale->data_ptr<at::Half>());
    return side;
  }
  if (!scale.has_value()) return side;
  TORCH_CHECK(side.dtype == kKvFp8, "only fp8 caches have scales");
  if (scale->dim() == 0) {
    side.static_scale = scale->to(at::kFloat).item<float>();
    side.inv_static = 1.f / side.static_scale;
  } else {
    TORCH_CHECK(scale->scalar_type() == at::kChar && scale->is_contiguous() &&
                    scale->numel() == cache.size(0) * cache.size(1) * cache.size(2),
                "dynamic scales: contiguous int8 exponents [pages, kv_heads, page_size]");
    side.exponent_tensor = *scale;
    side.exponents = scale->data_ptr<int8_t>();
  }
  return side;
}

// Cached K/V bytes widened to float32 times `scale`, as the decode attention reads them
// (dtype: kKvF32 / kKvBf16 / kKvFp8 / kKvInt8): lets tests check every code of every format.
at::Tensor widen_kv(const at::Tensor& raw, int64_t dtype, double scale,
                    const at::Tensor& fp8_table, const std::string& isa) {
  TORCH_CHECK(raw.dim() == 1 && raw.is_contiguous(), "raw: 1-D contiguous");
  const int64_t element = dtype == kKvF32 ? 4 : (dtype == kKvBf16 ? 2 : 1);
  TORCH_CHECK(raw.element_size() == element, "raw: ", element, "-byte elements for this dtype");
  const at::Tensor table = fp8_table.contiguous().to(at::kFloat);
  TORCH_CHECK(table.numel() == 256, "fp8 table: 256 float32 values");
  const int64_t n = raw.numel();
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
  const int kind = static_cast<int>(dtype);
  if (parse_isa(isa) == Isa::kAvx512Vnni) {
    Avx512::widen(raw.data_ptr(), kind, static_cast<int>(n), static_cast<float>(scale),
                  table.data_ptr<float>(), out.data_ptr<float>());
  } else {
    Avx2::widen(raw.data_ptr(), kind, static_cast<int>(n), static_cast<float>(scale),
                table.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

// Tiled causal prefill attention over pages (prefill_attention.cpp): q [T, H, D] float32,
// the layer's K/V pages and scales, page_table [B, max_pages] / seq_lens / query_lens [B] int32,
// new_k / new_v [T, Hkv, D] float32 or None -> [T, H, D] float32.
at::Tensor prefill_attention_op(const at::Tensor& q, const at::Tensor& k_cache,
                                const std::optional<at::Tensor>& k_scale,
                                const at::Tensor& v_cache,
                                const std::optional<at::Tensor>& v_scale,
                                const at::Tensor& page_table, const at::Tensor& seq_lens,
                                const at::Tensor& query_lens, double sm_scale,
                                const std::optional<at::Tensor>& new_k,
                                const std::optional<at::Tensor>& new_v,
                                const at::Tensor& fp8_table, const std::string& isa) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q: contiguous float32 [T, H, D]");
  const KVSide k = make_kv_side(k_cache, k_scale), v = make_kv_side(v_cache, v_scale);
  TORCH_CHECK(k_cache.size(3) == q.size(2) && v_cache.sizes() == k_cache.sizes(),
              "K/V pages: [pages, kv_heads, page_size, head_dim] of q's head_dim");
  for (const at::Tensor* t : {&page_table, &seq_lens, &query_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "metadata: contiguous int32");
  const int64_t batch = seq_lens.numel();
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == batch && query_lens.numel() == batch,
              "page_table [B, max_pages], seq_lens and query_lens [B]");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qlens = query_lens.data_ptr<int32_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(qlens[b] >= 1 && lens[b] >= qlens[b], "need 1 <= query_len <= seq_len");
    TORCH_CHECK((lens[b] + k.page_size - 1) / k.page_size <= page_table.size(1),
                "page_table is shorter than seq_len");
    total += qlens[b];
  }
  TORCH_CHECK(total == q.size(0), "q has ", q.size(0), " rows, query_lens add up to ", total);
  const int32_t* table = page_table.data_ptr<int32_t>();
  for (int64_t i = 0; i < page_table.numel(); ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < k_cache.size(0), "page id out of range");
  const at::Tensor widths = fp8_table.contiguous().to(at::kFloat);
  TORCH_CHECK(widths.numel() == 256, "fp8 table: 256 float32 values");
  auto fresh = [&](const std::optional<at::Tensor>& t) -> const float* {
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == total && t->size(1) == k.num_kv_heads && t->size(2) == q.size(2),
                "new_k / new_v: contiguous float32 [T, Hkv, D]");
    return t->data_ptr<float>();
  };
  at::Tensor out = at::empty_like(q);
  PrefillInputs in{q.data_ptr<float>(), q.size(1), q.size(2), table, page_table.size(1),
                   lens, qlens, batch, static_cast<float>(sm_scale), fresh(new_k), fresh(new_v),
                   widths.data_ptr<float>(), out.data_ptr<float>()};
  prefill_attention(k, v, in, parse_isa(isa));
  return out;
}

class PyDecoder {
 public:
  PyDecoder(std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, double> shape,
            const std::string& isa, at::Tensor embed, at::Tensor final_norm, at::Tensor cos,
            at::Tensor sin, at::Tensor fp8_table) {
    auto [hidden, inter, heads, kv_heads, head_dim, eps] = shape;
    TORCH_CHECK(heads % kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
    dec_.config = {hidden, inter, heads, kv_heads, head_dim, static_cast<float>(eps)};
    dec_.isa = parse_isa(isa);
    dec_.embed = float_rows(embed, hidden, "embedding");
    dec_.final_norm_tensor = float_rows(final_norm.view({1, -1}), hidden, "final norm");
    dec_.final_norm = dec_.final_norm_tensor.data_ptr<float>();
    dec_.cos = float_rows(cos, head_dim, "rope cos");
    dec_.sin = float_rows(sin, head_dim, "rope sin");
    dec_.fp8_table_tensor = fp8_table.contiguous().to(at::kFloat);
    TORCH_CHECK(dec_.fp8_table_tensor.numel() == 256, "fp8 table: 256 float32 values");
    dec_.fp8_table = dec_.fp8_table_tensor.data_ptr<float>();
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, const AnyProjectionSpec& qkv,
                 const AnyProjectionSpec& o, const AnyProjectionSpec& gate_up,
                 const AnyProjectionSpec& down, at::Tensor k, std::optional<at::Tensor> k_scale,
                 at::Tensor v, std::optional<at::Tensor> v_scale,
                 std::optional<at::Tensor> k_center) {
    const Config& c = dec_.config;
    Layer layer;
    layer.norms = at::stack({input_norm.to(at::kFloat), post_norm.to(at::kFloat)}).contiguous();
    TORCH_CHECK(layer.norms.size(1) == c.hidden, "norm weights: [hidden]");
    layer.input_norm = layer.norms.data_ptr<float>();
    layer.post_norm = layer.input_norm + c.hidden;
    layer.qkv = make_projection(qkv);
    layer.o = make_projection(o);
    layer.gate_up = make_projection(gate_up);
    layer.down = make_projection(down);
    const int64_t d = c.head_dim;
    TORCH_CHECK(layer.qkv.in == c.hidden && layer.qkv.out == (c.num_heads + 2 * c.num_kv_heads) * d,
                "qkv shape");
    TORCH_CHECK(layer.o.in == c.num_heads * d && layer.o.out == c.hidden, "o_proj shape");
    TORCH_CHECK(layer.gate_up.in == c.hidden && layer.gate_up.out == 2 * c.intermediate,
                "gate_up shape");
    TORCH_CHECK(layer.down.in == c.intermediate && layer.down.out == c.hidden, "down shape");
    layer.k = make_kv_side(k, k_scale);
    layer.v = make_kv_side(v, v_scale);
    TORCH_CHECK(k.size(1) == c.num_kv_heads && k.size(3) == d && v.sizes() == k.sizes(),
                "KV cache shape");
    if (k_center.has_value()) {
      layer.k_center_tensor = k_center->to(at::kFloat).contiguous();
      TORCH_CHECK(layer.k_center_tensor.numel() == c.num_kv_heads * d, "k_center: [kv heads, head dim]");
      layer.k_center = layer.k_center_tensor.data_ptr<float>();
    }
    dec_.layers.push_back(std::move(layer));
  }

  // `embeddings`: the step's input rows [num_tokens, hidden] float32, required when the
  // decoder was built without an embedding table (0 rows), ignored otherwise.
  at::Tensor forward(const at::Tensor& token_ids, const at::Tensor& positions,
                     const at::Tensor& page_table, const at::Tensor& seq_lens,
                     const at::Tensor& slot_pages, const at::Tensor& slot_offsets,
                     const std::optional<at::Tensor>& embeddings) const {
    const int64_t rows = token_ids.numel();
    const bool own_table = dec_.embed.size(0) > 0;
    if (!own_table) {
      TORCH_CHECK(embeddings.has_value() && embeddings->scalar_type() == at::kFloat &&
                      embeddings->is_contiguous() && embeddings->dim() == 2 &&
                      embeddings->size(0) == rows && embeddings->size(1) == dec_.config.hidden,
                  "embeddings: float32 [num_tokens, hidden] (the decoder has no table)");
    }
    check(token_ids, at::kLong, rows, "token_ids");
    check(positions, at::kLong, rows, "positions");
    check(seq_lens, at::kInt, rows, "seq_lens");
    check(slot_pages, at::kLong, rows, "slot_pages");
    check(slot_offsets, at::kLong, rows, "slot_offsets");
    TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == rows &&
                    page_table.scalar_type() == at::kInt && page_table.is_contiguous(),
                "page_table: int32 [num_tokens, max_pages]");
    TORCH_CHECK(dec_.layers.size() > 0, "no layers added");
    // The kernels do no bounds checks: validate every index they will follow.
    const KVSide& kv = dec_.layers[0].k;
    const int64_t num_pages = kv.tensor.size(0);
    if (rows > 0) {
      TORCH_CHECK(!own_table || (token_ids.min().item<int64_t>() >= 0 &&
                                  token_ids.max().item<int64_t>() < dec_.embed.size(0)),
                  "token id out of range");
      TORCH_CHECK(positions.min().item<int64_t>() >= 0 &&
                      positions.max().item<int64_t>() < dec_.cos.size(0),
                  "position out of range");
      TORCH_CHECK(page_table.min().item<int32_t>() >= 0 &&
                      page_table.max().item<int32_t>() < num_pages,
                  "page id out of range");
      TORCH_CHECK(slot_pages.min().item<int64_t>() >= 0 &&
                      slot_pages.max().item<int64_t>() < num_pages,
                  "slot page out of range");
      TORCH_CHECK(slot_offsets.min().item<int64_t>() >= 0 &&
                      slot_offsets.max().item<int64_t>() < kv.page_size,
                  "slot offset out of range");
      TORCH_CHECK(seq_lens.min().item<int32_t>() >= 1 &&
                      seq_lens.max().item<int32_t>() <= page_table.size(1) * kv.page_size,
                  "seq_lens out of range");
    }
    StepInputs step{rows,
                    token_ids.data_ptr<int64_t>(),
                    positions.data_ptr<int64_t>(),
                    page_table.data_ptr<int32_t>(),
                    page_table.size(1),
                    seq_lens.data_ptr<int32_t>(),
                    slot_pages.data_ptr<int64_t>(),
                    slot_offsets.data_ptr<int64_t>(),
                    own_table ? nullptr : embeddings->data_ptr<float>()};
    return dec_.forward(step);
  }

  int64_t num_layers() const { return static_cast<int64_t>(dec_.layers.size()); }

  // The two halves of one layer around an attention computed elsewhere (prefill, mixed steps).
  at::Tensor qkv(int64_t layer, at::Tensor x, const at::Tensor& positions,
                 const at::Tensor& slot_pages, const at::Tensor& slot_offsets) const {
    check_stream(layer, x);
    const int64_t rows = x.size(0);
    check(positions, at::kLong, rows, "positions");
    check(slot_pages, at::kLong, rows, "slot_pages");
    check(slot_offsets, at::kLong, rows, "slot_offsets");
    if (rows > 0) {
      const KVSide& kv = dec_.layers[0].k;
      TORCH_CHECK(positions.min().item<int64_t>() >= 0 &&
                      positions.max().item<int64_t>() < dec_.cos.size(0),
                  "position out of range");
      TORCH_CHECK(slot_pages.min().item<int64_t>() >= 0 &&
                      slot_pages.max().item<int64_t>() < kv.tensor.size(0),
                  "slot page out of range");
      TORCH_CHECK(slot_offsets.min().item<int64_t>() >= 0 &&
                      slot_offsets.max().item<int64_t>() < kv.page_size,
                  "slot offset out of range");
    }
    return dec_.qkv(layer, x, positions.data_ptr<int64_t>(), slot_pages.data_ptr<int64_t>(),
                    slot_offsets.data_ptr<int64_t>());
  }

  at::Tensor attend(int64_t layer, const at::Tensor& qkv, const at::Tensor& page_table,
                    const at::Tensor& seq_lens) const {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "layer out of range");
    const Config& c = dec_.config;
    TORCH_CHECK(qkv.dim() == 2, "qkv: float32 [rows, q + 2 kv]");
    const int64_t rows = qkv.size(0);
    check(qkv, at::kFloat, rows * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, "qkv");
    check(seq_lens, at::kInt, rows, "seq_lens");
    TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == rows &&
                    page_table.scalar_type() == at::kInt && page_table.is_contiguous(),
                "page_table: int32 [rows, max_pages]");
    if (rows > 0) {  // the kernel does no bounds checks: validate every index it will follow
      const KVSide& kv = dec_.layers[layer].k;
      TORCH_CHECK(page_table.min().item<int32_t>() >= 0 &&
                      page_table.max().item<int32_t>() < kv.tensor.size(0),
                  "page id out of range");
      TORCH_CHECK(seq_lens.min().item<int32_t>() >= 1 &&
                      seq_lens.max().item<int32_t>() <= page_table.size(1) * kv.page_size,
                  "seq_lens out of range");
    }
    return dec_.attend(layer, qkv, page_table.data_ptr<int32_t>(), page_table.size(1),
                       seq_lens.data_ptr<int32_t>());
  }

  // The deterministic mode's attention (Decoder::attend_tiled): B sequences, query_lens[b] rows
  // each, in qkv's row order.
  at::Tensor attend_tiled(int64_t layer, const at::Tensor& qkv, const at::Tensor& page_table,
                          const at::Tensor& seq_lens, const at::Tensor& query_lens) const {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "layer out of range");
    const Config& c = dec_.config;
    TORCH_CHECK(qkv.dim() == 2, "qkv: float32 [rows, q + 2 kv]");
    const int64_t rows = qkv.size(0), batch = seq_lens.numel();
    check(qkv, at::kFloat, rows * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, "qkv");
    check(seq_lens, at::kInt, batch, "seq_lens");
    check(query_lens, at::kInt, batch, "query_lens");
    TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == batch &&
                    page_table.scalar_type() == at::kInt && page_table.is_contiguous(),
                "page_table: int32 [B, max_pages]");
    const KVSide& kv = dec_.layers[layer].k;
    if (batch > 0) {  // the kernel does no bounds checks: validate every index it will follow
      TORCH_CHECK(page_table.min().item<int32_t>() >= 0 &&
                      page_table.max().item<int32_t>() < kv.tensor.size(0),
                  "page id out of range");
    }
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    const int32_t* qlens = query_lens.data_ptr<int32_t>();
    int64_t total = 0;
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(qlens[b] >= 1 && lens[b] >= qlens[b] &&
                      lens[b] <= page_table.size(1) * kv.page_size,
                  "need 1 <= query_len <= seq_len <= max_pages * page_size");
      total += qlens[b];
    }
    TORCH_CHECK(total == rows, "query_lens must add up to qkv's rows");
    return dec_.attend_tiled(layer, qkv, page_table.data_ptr<int32_t>(), page_table.size(1),
                             lens, qlens, batch);
  }

  void set_tiled_attention(bool on) { dec_.tiled_attention = on; }

  void mlp(int64_t layer, const at::Tensor& attn, at::Tensor x) const {
    check_stream(layer, x);
    check(attn, at::kFloat, x.size(0) * dec_.config.num_heads * dec_.config.head_dim, "attn");
    dec_.mlp(layer, attn, x);
  }

  at::Tensor final_norm(at::Tensor x) const {
    check_stream(0, x);
    return dec_.final(x);
  }

 private:
  static at::Tensor float_rows(const at::Tensor& t, int64_t width, const char* what) {
    TORCH_CHECK(t.dim() == 2 && t.size(1) == width, what, ": [rows, ", width, "]");
    return t.contiguous().to(at::kFloat);
  }

  // The residual stream: float32 [M, hidden], contiguous, written in place.
  void check_stream(int64_t layer, const at::Tensor& x) const {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "layer out of range");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == dec_.config.hidden && x.scalar_type() == at::kFloat &&
                    x.is_contiguous() && x.device().is_cpu(),
                "x: contiguous float32 [M, hidden]");
  }

  static void check(const at::Tensor& t, at::ScalarType dtype, int64_t n, const char* what) {
    TORCH_CHECK(t.scalar_type() == dtype && t.numel() == n && t.is_contiguous() &&
                    t.device().is_cpu(),
                what, ": contiguous CPU tensor of ", n, " elements of ", dtype);
  }

  Decoder dec_;
};

}  // namespace
}  // namespace densa

// Every call that computes runs without the GIL (`Release`): a real model's step spends seconds
// in here, and the engine's heartbeat is a Python thread that must keep beating meanwhile
// (issue 21). pybind11 converts the arguments before the guard drops the GIL and converts the
// result after it takes it back, so only ATen runs in between: tensors are allocated, checked
// and read through ATen, which needs no GIL; no Python object is touched. Concurrent calls are
// safe: the kernels' scratch buffers are thread_local. Construction (`Decoder`, `add_layer`)
// keeps the GIL: it is short, and it mutates the decoder that `forward` reads.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  using namespace densa;
  using Release = pybind11::call_guard<pybind11::gil_scoped_release>;
  module.doc() =
      "densa's C++ CPU kernels: W4A8 / W5A8 / W5MA8 / W6A8 / W6MA8 / W8A8 matmuls and the fused "
      "decode step";
  module.def("best_isa", &best_isa, "the fastest code path this CPU runs ('' if none)");
  module.def("pack_w4", &pack_w4, Release(), "W4 codes [N,K] u8, d/m [N,K/32] -> packed blocks");
  module.def("pack_w8", &pack_w8, Release(),
             "W8 codes [N,K] s8, d [N,K/32], isa -> packed blocks");
  module.def("pack_w6", &pack_w6, Release(),
             "W6 codes [N,K] s8 in -32..31, d [N,K/32], sc [N,K/16] s8 -> packed blocks");
  module.def("pack_w6m", &pack_w6m, Release(),
             "W6 codes [N,K] s8 in -32..31, d/m [N,K/32], sc [N,K/16] s8 -> packed W6M blocks");
  module.def("pack_w5", &pack_w5, Release(),
             "W5 codes [N,K] s8 in -16..15, d [N,K/32], sc [N,K/16] s8 -> packed blocks");
  module.def("pack_w5m", &pack_w5m, Release(),
             "W5M codes [N,K] s8 in 0..31, d/m [N,K/32], sc [N,K/16] s8 -> packed W5M blocks");
  module.def(
      "w4a8_linear",
      [](const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::string& isa) {
        return quantized_linear(x, packed, n, 4, isa);
      },
      Release(), "x [M,K] f32, packed W4, N, isa -> [M,N] f32");
  module.def(
      "w8a8_linear",
      [](const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::string& isa) {
        return quantized_linear(x, packed, n, 8, isa);
      },
      Release(), "x [M,K] f32, packed W8, N, isa -> [M,N] f32");
  module.def(
      "w6a8_linear",
      [](const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::string& isa) {
        return quantized_linear(x, packed, n, kFormatW6A8, isa);
      },
      Release(), "x [M,K] f32, packed W6, N, isa -> [M,N] f32");
  module.def(
      "w6ma8_linear",
      [](const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::string& isa) {
        return quantized_linear(x, packed, n, kFormatW6MA8, isa);
      },
      Release(), "x [M,K] f32, packed W6M, N, isa -> [M,N] f32");
  module.def(
      "w5a8_linear",
      [](const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::string& isa) {
        return quantized_linear(x, packed, n, kFormatW5A8, isa);
      },
      Release(), "x [M,K] f32, packed W5, N, isa -> [M,N] f32");
  module.def(
      "w5ma8_linear",
      [](const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::string& isa) {
        return quantized_linear(x, packed, n, kFormatW5MA8, isa);
      },
      Release(), "x [M,K] f32, packed W5M, N, isa -> [M,N] f32");
  module.def("pack_fp4", &pack_fp4, Release(),
             "qweight [N,K/2] u8, scales [N,K/g] u8, tensor scale [N] f32 (NVFP4), bits -> "
             "packed MXFP4 / NVFP4 blocks");
  module.def(
      "fp4a8_linear",
      [](const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t bits,
         const std::string& isa) { return quantized_linear(x, packed, n, bits, isa); },
      Release(), "x [M,K] f32, packed MXFP4 / NVFP4, N, bits (41 / 42), isa -> [M,N] f32");
  module.def("fp4float_linear", &fp4float_linear, Release(),
             "x [M,K] f32, packed MXFP4 / NVFP4, N, bits (43 / 44), isa -> [M,N] f32 "
             "(weight-only: float32 activations)");
  module.def("widen_kv", &widen_kv, Release(),
             "raw K/V bytes [n], dtype code, scale, fp8 table, isa -> f32");
  module.def("prefill_attention", &prefill_attention_op, Release(),
             "q, k, k_scale, v, v_scale, page_table, seq_lens, query_lens, sm_scale, new_k, "
             "new_v, fp8 table, isa -> tiled causal prefill attention [T, H, D]");
  module.def("delta_rule_steps", &delta_rule_steps, Release(),
             "state_pool [slots, H, Dk, Dv] (updated in place), slot_ids [B], q, k [B, T, H, Dk], "
             "v [B, T, H, Dv], log_decay [B, T, H(, Dk)], beta [B, T, H], isa -> out [B, T, H, Dv]");
  module.def("context_splits", &context_splits,
             "items, threads, longest context -> parts per (sequence, kv head) at decode");
  module.def("pack_w8float", &pack_w8float, Release(),
             "W8 codes [N,K] s8, d [N,K/32] -> w8 blocks");
  module.def("w8float_linear", &w8float_linear, Release(),
             "x [M,K] f32, w8 blocks, N, isa -> [M,N] f32");
  pybind11::class_<PyDecoder>(module, "Decoder")
      .def(pybind11::init<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, double>,
                          const std::string&, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          at::Tensor>())
      .def("add_layer", &PyDecoder::add_layer)
      .def("forward", &PyDecoder::forward, Release())
      .def("qkv", &PyDecoder::qkv, Release())
      .def("attend", &PyDecoder::attend, Release())
      .def("attend_tiled", &PyDecoder::attend_tiled, Release())
      .def("set_tiled_attention", &PyDecoder::set_tiled_attention)
      .def("mlp", &PyDecoder::mlp, Release())
      .def("final_norm", &PyDecoder::final_norm, Release())
      .def_property_readonly("num_layers", &PyDecoder::num_layers);
}
