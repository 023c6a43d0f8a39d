// The int8 codes for many rows (prefill) and for tests: widened to the activations' dtype a cache-sized chunk at a time
// and multiplied by torch's dense matmul, or unpacked whole. Layout: int8_layout.h.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/ops/mm_ops.h>

#include <algorithm>
#include <bit>
#include <cstdint>

#include "int8_layout.h"
#include "ops.h"

namespace radixserve::cpu {

namespace {
using radixserve::int8::check_packed;
using radixserve::int8::kCols;
using radixserve::int8::kRows;
using radixserve::int8::unpack_into;
}  // namespace

// The codes as a plain [N, K] matrix of `dtype` (float32 or bfloat16; int8 values are exact in both), unscaled.
at::Tensor int8_unpack(const at::Tensor& packed, at::ScalarType dtype) {
  check_packed(packed);
  const int64_t NB = packed.size(0), K = packed.size(1) * kCols;
  at::Tensor out = packed.new_empty({NB * kRows, K}, dtype);
  if (dtype == at::kFloat)
    unpack_into(packed.data_ptr<uint8_t>(), NB, K, out.data_ptr<float>());
  else if (dtype == at::kBFloat16)
    unpack_into(packed.data_ptr<uint8_t>(), NB, K, out.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "int8_unpack: dtype must be float32 or bfloat16");
  return out;
}

namespace {

// y[m, c] *= s[c] for a block of columns with row stride ld, rounding as torch's multiply does (a vectorizable loop:
// torch's broadcasting mul_ over these strided blocks ran at ~2 GB/s, 5% of a 96-token step).
void scale_columns(float* y, int64_t rows, int64_t cols, int64_t ld, const float* s) {
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
      for (int64_t c = 0; c < cols; c++) y[r * ld + c] *= s[c];
  });
}

// bf16 as bits, so the compiler vectorizes it: widen, multiply in float, round to nearest even (finite values).
void scale_columns(at::BFloat16* y, int64_t rows, int64_t cols, int64_t ld, const at::BFloat16* s) {
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      uint16_t* row = reinterpret_cast<uint16_t*>(y + r * ld);
      const uint16_t* sc = reinterpret_cast<const uint16_t*>(s);
      for (int64_t c = 0; c < cols; c++) {
        const float v = std::bit_cast<float>(static_cast<uint32_t>(row[c]) << 16) *
                        std::bit_cast<float>(static_cast<uint32_t>(sc[c]) << 16);
        const uint32_t u = std::bit_cast<uint32_t>(v);
        row[c] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
      }
    }
  });
}

}  // namespace

// y = x (codes * scale)^T [M, out_features] for many rows (prefill): the codes are widened 1 MiB at a time into a
// buffer that stays in cache and multiplied by torch's dense matmul (oneDNN; bf16 or float32 as x), so no widened
// copy of the whole matrix is ever allocated (a fresh 0.3-0.5 GB temporary per call cost more in page faults than
// the matmul).
at::Tensor int8_linear_dense(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                             int64_t out_features) {
  check_packed(packed);
  const int64_t NB = packed.size(0), K = packed.size(1) * kCols, N = NB * kRows, M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [M, ", K, "]");
  TORCH_CHECK(out_features <= N, "out_features > the codes' rows");
  const int64_t chunk = std::max<int64_t>(kRows, (int64_t{1} << 20) / (K * x.element_size()) / kRows * kRows);
  at::Tensor y = x.new_empty({M, out_features});
  const at::Tensor xc = x.contiguous(), s = scale.to(x.scalar_type());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  // Each thread takes whole chunks (one parallel region per call: waking the sleeping OpenMP threads per chunk cost
  // more than the work); inside it the widening, the matmul and the scaling run on that thread alone.
  const at::ThreadLocalState caller;  // inference mode and the like, for the ATen calls on the worker threads
  at::parallel_for(0, (out_features + chunk - 1) / chunk, 1, [&](int64_t c0, int64_t c1) {
    const at::ThreadLocalStateGuard same_as_caller(caller);
    at::Tensor buf = x.new_empty({chunk, K});
    for (int64_t c = c0; c < c1; c++) {
      const int64_t n0 = c * chunk, cols = std::min(chunk, out_features - n0);
      const int64_t blocks = (std::min(chunk, N - n0) + kRows - 1) / kRows;
      if (x.scalar_type() == at::kBFloat16)
        unpack_into(w + n0 * K, blocks, K, buf.data_ptr<at::BFloat16>());
      else
        unpack_into(w + n0 * K, blocks, K, buf.data_ptr<float>());
      // Straight into y's columns (row stride out_features: the matmul's ldc), scaled while they are in cache.
      at::Tensor out = y.narrow(1, n0, cols);
      at::_ops::mm_out::call(xc, buf.narrow(0, 0, cols).t(), out);  // at::mm_out (ATen/ops/mm.h: ATen/Context.h)
      if (x.scalar_type() == at::kBFloat16)
        scale_columns(y.data_ptr<at::BFloat16>() + n0, M, cols, out_features, s.data_ptr<at::BFloat16>() + n0);
      else
        scale_columns(y.data_ptr<float>() + n0, M, cols, out_features, s.data_ptr<float>() + n0);
    }
  });
  return y;
}

}  // namespace radixserve::cpu
