// GGUF blocks as float weights, and the activations' rounding, for the tests (against gguf-py's dequantizers and a
// PyTorch reference of ggml's q8_0 rounding) and for the token embedding (only the looked-up rows are dequantized).
// The same unpacking (gguf_blocks.h) and rounding (gguf_activations.h) as the linears in gguf_linear.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include "gguf_activations.h"
#include "gguf_blocks.h"
#include "ops.h"

#include <optional>
#include <tuple>
#include <vector>

namespace radixserve::cpu {

namespace {
using radixserve::gguf::format_of;
using radixserve::gguf::kSub;
using radixserve::gguf::kXBlock;
using radixserve::gguf::quantize_block;
using radixserve::gguf::quantize_block256;
using radixserve::gguf::rounds_per_256;
using radixserve::gguf::unpack_row;
using radixserve::gguf::weights_row;
}  // namespace

// The weights of `blocks` [N, bytes] (all rows, or rows `ids`) as float32 [rows, K]: w = a u - b, rounded once.
// Serves the tests (against gguf-py's dequantizers) and the embedding lookup of a GGUF's token table.
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, const std::optional<at::Tensor>& ids) {
  const auto f = format_of(type);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be uint8 [N, bytes]");
  TORCH_CHECK(blocks.size(1) % f.bytes == 0, "row bytes are not whole blocks");
  const int64_t K = blocks.size(1) / f.bytes * f.weights;
  const at::Tensor rows = ids ? ids->to(at::kLong).contiguous() : at::Tensor();
  const int64_t R = ids ? rows.numel() : blocks.size(0);
  at::Tensor out = blocks.new_empty({R, K}, at::kFloat);
  const int64_t* idx = ids ? rows.data_ptr<int64_t>() : nullptr;  // none: every row, in order
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; idx && i < R; i++) TORCH_CHECK(idx[i] >= 0 && idx[i] < blocks.size(0), "row index out of range");
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> u(K);
    std::vector<float> a(K / kSub), b(K / kSub);
    for (int64_t r = r0; r < r1; r++) {
      unpack_row(type, src + (idx ? idx[r] : r) * blocks.size(1), K, u.data(), a.data(), b.data());
      weights_row(u.data(), a.data(), b.data(), K, dst + r * K);
    }
  });
  return out;
}

// The activation rounding every dot product starts from: (int8 codes [M, K], float32 scales [M, K / block]), per
// block of 32 columns (q8_0) or 256 (q8_K: what this build's K-quants read where gguf_activation_block says so).
std::tuple<at::Tensor, at::Tensor> gguf_quantize_activations(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(block == kXBlock || block == 256, "block must be 32 or 256");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % block == 0, "x must be [M, K] with K a multiple of ", block);
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor q = x.new_empty({M, K}, at::kChar);
  at::Tensor s = x.new_empty({M, K / block}, at::kFloat);
  for (int64_t m = 0; m < M; m++)
    for (int64_t blk = 0; blk < K / block; blk++) {
      const float* in = xf.data_ptr<float>() + m * K + blk * block;
      int8_t* out = q.data_ptr<int8_t>() + m * K + blk * block;
      float& scale = s.data_ptr<float>()[m * (K / block) + blk];
      block == kXBlock ? quantize_block(in, out, scale) : quantize_block256(in, out, scale);
    }
  return {q, s};
}

// The columns per activation scale that this build's linears read for a block type: 256 for the K-quants on the
// AVX2 path (kRound256), else 32.
int64_t gguf_activation_block(int64_t type) { return rounds_per_256(type) ? 256 : kXBlock; }

}  // namespace radixserve::cpu
