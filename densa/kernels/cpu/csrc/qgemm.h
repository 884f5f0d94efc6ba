// Shared declarations of densa's C++ CPU kernels (see qgemm.cpp for the formats and layout).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <string>

namespace densa {

constexpr int kGroup = 32;     // input columns per scale
constexpr int kPanel = 16;     // output rows per block
constexpr int kW4Block = 320;  // bytes per W4 block: 256 codes + 32 d + 32 m
constexpr int kW8Block = 544;  // bytes per W8 block: 512 codes + 32 d
constexpr int kW6Block = 448;  // bytes per W6 block: 256 nibbles + 128 high bits + 32 sc + 32 d
constexpr int kW6MBlock = 480;  // bytes per W6M block: a W6 block + 16 x fp16 m
constexpr int kW5Block = 384;  // bytes per W5 block: 256 nibbles + 64 high bits + 32 sc + 32 d
constexpr int kW5MBlock = 416;  // bytes per W5M block: a W5 block + 16 x fp16 m
constexpr int kMxfp4Block = 272;  // bytes per MXFP4 block: 256 nibbles + 16 x e8m0 (fp4gemm.cpp)
constexpr int kNvfp4Block = 288;  // bytes per NVFP4 block: 256 nibbles + 32 x e4m3 (fp4gemm.cpp)

// Software prefetch of a weight stream (qgemm.cpp, w8float.cpp): a panel's blocks are read
// front to back, but at batch 1 there is little arithmetic between loads to hide DRAM latency
// behind, and the hardware prefetchers restart at every 4 KiB page. Asking for the block
// kPrefetchBytes ahead (in the same panel or the next, the next work item) keeps loads in
// flight; 2.5 KiB was the best of 0.6-16 KiB tried on SmolLM2's shapes.
constexpr int kPrefetchBytes = 2560;

inline void prefetch_weights(const uint8_t* block, int bytes) {
  for (int off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes + off), _MM_HINT_T0);
}

enum class Isa { kAvx2 = 0, kAvx512Vnni = 1 };

// Projection formats, as Python passes them ("bits"): dense float32, W4A8, W5A8, W5MA8 (W5 with
// a minimum per group), W6A8, W6MA8 (W6 with a minimum), W8A8, W8 with float activations
// (w8float.cpp), and the FP4 formats with int8 activations, MXFP4A8 and NVFP4A8, or with float32
// activations (weight-only), MXFP4 and NVFP4: the same blocks, two kernels (fp4gemm.cpp).
constexpr int kFormatDense = 32, kFormatW4A8 = 4, kFormatW5A8 = 5, kFormatW5MA8 = 51,
              kFormatW6A8 = 6, kFormatW6MA8 = 7, kFormatW8A8 = 8, kFormatW8 = 80,
              kFormatMxfp4A8 = 41, kFormatNvfp4A8 = 42, kFormatMxfp4 = 43, kFormatNvfp4 = 44;

// Bytes per block of a packed format (0: not a packed format).
constexpr int block_bytes(int bits) {
  switch (bits) {
    case kFormatW4A8:
      return kW4Block;
    case kFormatW5A8:
      return kW5Block;
    case kFormatW5MA8:
      return kW5MBlock;
    case kFormatW6A8:
      return kW6Block;
    case kFormatW6MA8:
      return kW6MBlock;
    case kFormatW8A8:
    case kFormatW8:
      return kW8Block;
    case kFormatMxfp4A8:
    case kFormatMxfp4:
      return kMxfp4Block;
    case kFormatNvfp4A8:
    case kFormatNvfp4:
      return kNvfp4Block;
    default:
      return 0;
  }
}

// Bytes of an [n, k] weight packed as `bits`: its blocks, and for NVFP4 one float32 tensor
// scale per output row after them (each row keeps its own tensor's scale: a fused q|k|v of
// three NVFP4 tensors holds three).
constexpr int64_t packed_bytes(int bits, int64_t n, int64_t k) {
  const int64_t blocks = (n / kPanel) * (k / kGroup) * block_bytes(bits);
  return bits == kFormatNvfp4A8 || bits == kFormatNvfp4 ? blocks + 4 * n : blocks;
}

bool cpu_has_avx512_vnni();
bool cpu_has_avx2();
Isa parse_isa(const std::string& name);
std::string best_isa();

// Scratch for int8 activations of up to `rows` x `cols`; reused across calls. Per row and
// group: dx, sumx and sumq; sumh holds the two 16-input halves' sums of qx (W6's offset).
struct ActivationBuffers {
  at::Tensor qx, dx, sumx, sumq, sumh;
  void ensure(int64_t rows, int64_t cols);
};

// Whether `bits` names one of the split formats: 4-bit nibbles plus a plane of high bits, an
// int8 scale per 16 inputs (qgemm.cpp: W5, W5M, W6, W6M).
constexpr bool is_split_format(int bits) {
  return bits == kFormatW5A8 || bits == kFormatW5MA8 || bits == kFormatW6A8 ||
         bits == kFormatW6MA8;
}

constexpr bool is_fp4_format(int bits) { return bits == kFormatMxfp4A8 || bits == kFormatNvfp4A8; }
// The weight-only FP4 formats (float32 activations; fp4float_linear_raw runs them).
constexpr bool is_fp4_float_format(int bits) { return bits == kFormatMxfp4 || bits == kFormatNvfp4; }

// Whether `bits` names a format with int8 activations (quantized_linear_raw runs it).
constexpr bool is_quantized_format(int bits) {
  return bits == kFormatW4A8 || is_split_format(bits) || bits == kFormatW8A8 || is_fp4_format(bits);
}

// A panel kernel: one panel's blocks (`groups` of them) times a tile of tokens' int8
// activations (qx, dx and the per-group sums the format reads), into y (rows `ldy` apart). The
// token tile is a template parameter of each kernel (registers): fns[t - 1] handles t tokens.
using Int8PanelFn = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const void*,
                         int64_t, float*, int64_t);
constexpr int kInt8TileAvx512 = 8;  // 8 int + 8 float accumulators + temporaries: < 32 zmm
constexpr int kInt8TileAvx2 = 2;    // 2 x 2 int + 2 x 2 float accumulators + temporaries: < 16 ymm
// W4, FP4 and the split formats run one 8-row half at a time: 4 int + 4 float accumulators.
constexpr int kInt8TileAvx2W4 = 4;
struct Int8PanelKernels {
  Int8PanelFn fns[kInt8TileAvx512];
  int tile;
};

// The FP4 formats' panel kernels (fp4gemm.cpp): MXFP4 reads the groups' int32 sums of qx
// (sumq), NVFP4 the two halves' (sumh).
Int8PanelKernels fp4_panel_kernels(int bits, Isa isa);
// NVFP4: y[r, c] *= the tensor scale of output c, for rows [0, rows) of y (after the panels).
void apply_tensor_scales(const uint8_t* blocks, int64_t n, int64_t k, int64_t rows, float* y,
                         int64_t ldy);

// y[rows, n] = x[rows, cols] W^T for W packed as `bits` (4, 5, 51, 6, 7 or 8) blocks; x, y float32,
// row-major; y's rows are `ldy` apart (>= n), so a shard of a wider output writes in place.
void quantized_linear_raw(const float* x, int64_t rows, int64_t cols, const uint8_t* blocks,
                          int64_t n, int bits, Isa isa, float* y, int64_t ldy,
                          ActivationBuffers& buffers);

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                            int bits, const std::string& isa_name);
// y[rows, n] = x W^T for W in MXFP4 / NVFP4 blocks with float32 x (no activation rounding).
void fp4float_linear_raw(const float* x, int64_t rows, int64_t cols, const uint8_t* blocks,
                         int64_t n, int bits, Isa isa, float* y, int64_t ldy);
at::Tensor fp4float_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                           int64_t bits, const std::string& isa_name);
// qweight [N, K/2] uint8 (column 2j in the low nibble), scales [N, K/g] uint8 (E8M0 for MXFP4,
// e4m3 bits for NVFP4), tensor_scale [N] float32 (NVFP4; empty for MXFP4) -> packed blocks.
at::Tensor pack_fp4(const at::Tensor& qweight, const at::Tensor& scales,
                    const at::Tensor& tensor_scale, int64_t bits);
at::Tensor pack_w4(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m);
at::Tensor pack_w8(const at::Tensor& codes, const at::Tensor& d, const std::string& isa_name);
at::Tensor pack_w6(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& sc);
at::Tensor pack_w6m(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& sc,
                    const at::Tensor& m);
at::Tensor pack_w5(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& sc);
at::Tensor pack_w5m(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& sc,
                    const at::Tensor& m);

// Weight-only W8 (float activations): w8float.cpp.
void w8float_linear_raw(const float* x, int64_t rows, int64_t cols, const uint8_t* blocks,
                        int64_t n, Isa isa, float* y, int64_t ldy);
at::Tensor w8float_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                          const std::string& isa_name);
at::Tensor pack_w8float(const at::Tensor& codes, const at::Tensor& d);

}  // namespace densa
