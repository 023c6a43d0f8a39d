// Fused residual add + RMSNorm, and rotary embedding, for float32 and bfloat16 rows.
//
// Why: at one token per step each of these is a handful of torch ops on 896 numbers (add; rms_norm, weight multiply;
// RoPE's four multiplies, subtract, add and cat), ~5 us of dispatch apiece and ~300 per decode step of the default
// model. Each op here rounds where the torch sequence it replaces rounds (to the tensor's dtype after every
// elementwise step, as torch's bf16 ops do; the files build with -ffp-contract=off, so no multiply-add is fused),
// so the values are the torch path's: only RMSNorm's float32 sum of squares may add up in another order.
#include "ops.h"
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "bf16_lanes.h"

namespace {

template <typename T>
inline float rnd(float v) {  // the value torch stores for a T result
  return static_cast<float>(static_cast<T>(v));
}

// x[j] = rnd<T>(x[j] + res[j]) (res may be null: x unchanged) for j in [j0, j1); the squares of the values into
// lanes[j % 8]. Every build adds the squares into the same eight double lanes in the same order (a float's square is
// exact in double), so the norm's sum is one value whatever the vector width.
template <typename T>
void add_and_square(T* x, const T* res, int64_t j0, int64_t j1, double* lanes) {
  for (int64_t j = j0; j < j1; j++) {
    float v = static_cast<float>(x[j]);
    if (res) x[j] = static_cast<T>(v = rnd<T>(v + static_cast<float>(res[j])));
    lanes[j % 8] += static_cast<double>(v) * v;
  }
}

// One row: x becomes x + res (rounded to T), out = weight * rnd<T>(x * inv), inv = 1 / sqrt(mean of squares + eps).
// Vectorized because the scalar loop (bfloat16 conversions one value at a time and one serial sum) took ~25 us a
// call at 8 rows of 896, two calls a layer: ~1 ms of an 8-stream decode step of the default model.
template <typename T>
void add_rms_norm_row(T* x, const T* res, const T* weight, float eps, T* out, int64_t dim) {
  double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  using namespace radixserve::cpu::lanes;
  constexpr int64_t kStep = kLanes;
#if defined(__AVX512F__)
  __m512d acc = _mm512_setzero_pd();  // lane l: columns l, l + 8, l + 16, ... in that order
#else
  __m256d acc_lo = _mm256_setzero_pd(), acc_hi = _mm256_setzero_pd();
#endif
  for (; j + kStep <= dim; j += kStep) {
    Vec v = load(x + j);
    if (res) {
      v = round_to(x, v + load(res + j));
      store(x + j, v);
    }
#if defined(__AVX512F__)
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    acc = _mm512_add_pd(_mm512_add_pd(acc, _mm512_mul_pd(lo, lo)), _mm512_mul_pd(hi, hi));
#else
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    acc_lo = _mm256_add_pd(acc_lo, _mm256_mul_pd(lo, lo));
    acc_hi = _mm256_add_pd(acc_hi, _mm256_mul_pd(hi, hi));
#endif
  }
#if defined(__AVX512F__)
  _mm512_storeu_pd(lanes, acc);
#else
  _mm256_storeu_pd(lanes, acc_lo);
  _mm256_storeu_pd(lanes + 4, acc_hi);
#endif
#endif
  add_and_square(x, res, j, dim, lanes);
  const double sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  const float inv = 1.f / std::sqrt(static_cast<float>(sum / static_cast<double>(dim)) + eps);
  j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  const Vec vinv = splat(inv);
  for (; j + kStep <= dim; j += kStep) store(out + j, load(weight + j) * round_to(out, load(x + j) * vinv));
#endif
  for (; j < dim; j++) out[j] = static_cast<T>(static_cast<float>(weight[j]) * rnd<T>(static_cast<float>(x[j]) * inv));
}

template <typename T>
void add_rms_norm_rows(T* h, const T* residual, const T* weight, float eps, T* out, int64_t rows, int64_t dim) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
      add_rms_norm_row(h + r * dim, residual ? residual + r * dim : nullptr, weight, eps, out + r * dim, dim);
  });
}

template <typename T>
void rope_rows(const T* x, int64_t rows, int64_t heads, int64_t dim, int64_t x_row_stride, const T* cos,
               const T* sin, T* out) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
      for (int64_t hd = 0; hd < heads; hd++) {
        const T* xi = x + r * x_row_stride + hd * dim;
        T* o = out + (r * heads + hd) * dim;
        int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
        // The same roundings a vector at a time (scalar, the haswell build took ~27 us a call at 8 rows).
        using namespace radixserve::cpu::lanes;
        for (; j + kLanes <= half; j += kLanes) {
          const Vec c = load(cos + r * half + j), s = load(sin + r * half + j);
          const Vec x1 = load(xi + j), x2 = load(xi + half + j);
          store(o + j, round_to(o, x1 * c) - round_to(o, x2 * s));
          store(o + half + j, round_to(o, x2 * c) + round_to(o, x1 * s));
        }
#endif
        for (; j < half; j++) {
          const float c = static_cast<float>(cos[r * half + j]), s = static_cast<float>(sin[r * half + j]);
          const float x1 = static_cast<float>(xi[j]), x2 = static_cast<float>(xi[half + j]);
          o[j] = static_cast<T>(rnd<T>(x1 * c) - rnd<T>(x2 * s));
          o[half + j] = static_cast<T>(rnd<T>(x2 * c) + rnd<T>(x1 * s));
        }
      }
  });
}

}  // namespace

namespace radixserve::cpu {

// (h + residual, RMSNorm(h + residual) * weight), or (h, RMSNorm(h) * weight) without a residual; the inputs are
// not written. h and residual [rows, dim], weight [dim], all of one dtype.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && weight.dim() == 1 && weight.size(0) == h.size(1), "h [rows, dim], weight [dim]");
  TORCH_CHECK(weight.scalar_type() == h.scalar_type() && (!residual || residual->scalar_type() == h.scalar_type()),
              "h, residual and weight must share one dtype");
  at::Tensor sum = residual ? h.contiguous().clone() : h.contiguous();
  const at::Tensor res = residual ? residual->contiguous() : at::Tensor();
  const at::Tensor w = weight.contiguous();
  at::Tensor out = sum.new_empty(sum.sizes());
  const int64_t rows = sum.size(0), dim = sum.size(1);
  if (h.scalar_type() == at::kFloat) {
    add_rms_norm_rows(sum.data_ptr<float>(), residual ? res.data_ptr<float>() : nullptr, w.data_ptr<float>(),
                      static_cast<float>(eps), out.data_ptr<float>(), rows, dim);
  } else {
    TORCH_CHECK(h.scalar_type() == at::kBFloat16, "add_rms_norm: float32 or bfloat16");
    add_rms_norm_rows(sum.data_ptr<at::BFloat16>(), residual ? res.data_ptr<at::BFloat16>() : nullptr,
                      w.data_ptr<at::BFloat16>(), static_cast<float>(eps), out.data_ptr<at::BFloat16>(), rows, dim);
  }
  return {sum, out};
}

// radixserve/model/rope.py's apply_rope: x [T, heads, dim] (rows may be strided: a slice of the qkv output, heads
// and dim contiguous), cos/sin [T, 1, dim/2] contiguous, one dtype; out [T, heads, dim] contiguous.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x [T, heads, dim], heads and dim dense");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "one dtype");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(cos.numel() == rows * dim / 2 && sin.numel() == rows * dim / 2, "cos/sin [T, 1, dim/2]");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = x.new_empty({rows, heads, dim});
  if (x.scalar_type() == at::kFloat) {
    rope_rows(x.data_ptr<float>(), rows, heads, dim, x.stride(0), c.data_ptr<float>(), s.data_ptr<float>(),
              out.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rope: float32 or bfloat16");
    rope_rows(x.data_ptr<at::BFloat16>(), rows, heads, dim, x.stride(0), c.data_ptr<at::BFloat16>(),
              s.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  }
  return out;
}

// q and k of one step rotated by one call (the attention's q and k views of its qkv output, or Qwen3's normed
// ones): rope(q) and rope(k), with one dispatch where the Python that joined the two views into one cost more than
// the op.
std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                           const at::Tensor& sin) {
  return {rope(q, cos, sin), rope(k, cos, sin)};
}

}  // namespace radixserve::cpu
