// SiLU(gate) * up over the gate_up projection's output, one op where torch runs a split, a silu and a mul.
//
// Why: at one token per decode step the three ops cost ~6-7 us of dispatch and two allocations a layer for 4,864
// values of work. The values are torch's, bit for bit: torch's silu on float32 and bfloat16 rows computes
// x / (1 + exp(-x)) in float32 with Sleef's exp (its Vectorized<float>::exp) over pairs of vectors and libm's exp on
// the tail (the n mod 2 vectors it runs scalar), rounding once to the dtype; the mul widens both sides, multiplies in
// float32 and rounds (the file builds with -ffp-contract=off: nothing is fused). So this does the same, with the same
// Sleef functions (exported by libtorch_cpu): expf16 on AVX-512, expf8 on AVX2. A build for neither (x86-64) runs
// torch's own ops here, since its silu would still use a vector exp we cannot call.
#include "ops.h"
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/silu_ops.h>

#include <algorithm>
#include <cmath>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <sleef.h>
#endif

#include "bf16_lanes.h"
#include "spin_pool.h"

namespace {

using namespace radixserve::cpu::lanes;

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline float rnd(float v) {  // the value torch stores for a T result
  return static_cast<float>(static_cast<T>(v));
}

#if defined(__AVX512F__)
// 16 values: x / (1 + exp(-x)) rounded to T, times up, rounded to T.
template <typename T>
inline void silu_mul_lanes(const T* gate, const T* up, T* out) {
  const __m512 x = load(gate);
  const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
  const __m512 e = Sleef_expf16_u10(neg);
  const __m512 s = round_to(out, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
  store(out, _mm512_mul_ps(s, load(up)));
}
#elif defined(__AVX2__)
// 8 values, as the AVX-512 lanes above (one value at a time, its divisions took ~9 us a layer at 4,864 values).
template <typename T>
inline void silu_mul_lanes(const T* gate, const T* up, T* out) {
  const __m256 x = load(gate);
  const __m256 e = Sleef_expf8_u10(_mm256_xor_ps(x, _mm256_set1_ps(-0.f)));
  const __m256 s = round_to(out, _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
  store(out, _mm256_mul_ps(s, load(up)));
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// One row: gate and up n values each, out n values. torch's vectorized loop steps over 2 vectors of T at a time
// (a vector of bfloat16 holds twice the float lanes), so its scalar tail is n mod (2 * lanes * (4 / sizeof(T))).
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  const int64_t step = 2 * kLanes * static_cast<int64_t>(sizeof(float) / sizeof(T));
  const int64_t vec_end = n - n % step;
  for (int64_t j = 0; j < vec_end; j += kLanes) silu_mul_lanes(gate + j, up + j, out + j);
  for (int64_t j = vec_end; j < n; j++) {
    const float x = widen(gate[j]);
    out[j] = static_cast<T>(rnd<T>(x / (1.f + std::exp(-x))) * widen(up[j]));
  }
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// A decode step's few rows (at least kPoolValues values, at most kPoolRows rows) run on the decode kernels' spin pool
// in pieces of kPiece columns, whose workers still spin from the gate_up linear just before: at eight rows of 4,864
// one thread took ~30 us a layer (benchmarks.fused_ops). A piece starts at a multiple of torch's vector step, so only
// a row's last piece has the scalar tail: the values are those of the whole row at once. More rows take
// at::parallel_for by rows; fewer values stay on the calling thread.
constexpr int64_t kPoolRows = 16, kPoolValues = 16384, kPiece = 1024;
static_assert(kPiece % (4 * kLanes) == 0, "a piece is whole vector steps of bfloat16 and float32");

template <typename T>
void silu_mul_rows(const at::Tensor& x, at::Tensor& out, int64_t rows, int64_t n) {
  const T* in = x.data_ptr<T>();
  T* o = out.data_ptr<T>();
  if (rows <= kPoolRows && rows * n >= kPoolValues) {
    const int64_t pieces = (n + kPiece - 1) / kPiece;
    radixserve::SpinPool::get().run(rows * pieces, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; i++) {
        const int64_t r = i / pieces, c = i % pieces * kPiece, len = std::min(kPiece, n - c);
        silu_mul_row(in + r * 2 * n + c, in + r * 2 * n + n + c, o + r * n + c, len);
      }
    });
    return;
  }
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) silu_mul_row(in + r * 2 * n, in + r * 2 * n + n, o + r * n, n);
  });
}
#endif

}  // namespace

namespace radixserve::cpu {

// gate_up [rows, 2n] (gate then up, as MLP's fused projection writes them), float32 or bfloat16 -> [rows, n].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up [rows, 2n]");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16,
              "silu_mul: float32 or bfloat16");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
#if defined(__AVX512F__) || defined(__AVX2__)
  const at::Tensor x = gate_up.contiguous();
  at::Tensor out = x.new_empty({rows, n});
  if (x.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(x, out, rows, n);
  } else {
    silu_mul_rows<at::BFloat16>(x, out, rows, n);
  }
  return out;
#else
  const auto parts = gate_up.split(n, 1);
  return at::_ops::silu::call(parts[0]).mul(parts[1]);  // at::silu, operator*: ATen/Context.h again
#endif
}

}  // namespace radixserve::cpu
